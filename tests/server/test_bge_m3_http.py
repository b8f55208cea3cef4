"""A tiny BGE-M3 directory served (tests/model/checkpoints.bge_m3), in one process and through FRONTENDS=1's engine:
/v1/embeddings and /embed give its dense vectors, /embed_sparse and /v1/embeddings' sparse encoding its sparse head's
weights, /embed_all its multi-vectors (one per token after the first); /info and /v1/models list the outputs. Each answer equals
the model's own output for the same rows (tests/model/test_bge_m3.py holds those to FlagEmbedding), and the two
process models answer alike."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from fusedserve.model import load
from fusedserve.model.api import LoadOptions, TextOptions
from tests.model import checkpoints
from tests.model.test_bge_m3 import vocabulary_rows
from tests.server.test_startup import launch, stop, wait_ready
from tests.tolerances import assert_embeddings_close, assert_same_rows, assert_scores_close, assert_sparse_close

pytestmark = pytest.mark.slow

TEXTS = ["a man is eating food", "multi-vector retrieval scores by maxsim", "le chat dort"]


@pytest.fixture(scope="module")
def expected(tmp_path_factory):
    directory = checkpoints.bge_m3(tmp_path_factory.mktemp("bge-m3"))
    model = load(str(directory), LoadOptions(device="cpu", dtype="float32"))
    rows = model.prepare(TEXTS, TextOptions())
    outputs = {output: model.launch(rows, output=output).rows() for output in ("pooled", "colbert", "sparse")}
    outputs["sparse"] = vocabulary_rows(outputs["sparse"], rows, model.embedder.config.vocab_size)
    model.stop()
    return directory, rows, outputs


@pytest.mark.parametrize("frontends", [0, 1])
def test_the_three_outputs_over_http(tmp_path, expected, frontends):
    directory, rows, want = expected
    process, url, log_path = launch(tmp_path, model=str(directory), frontends=frontends, backend="torch",
                                    torch_threads=1, max_batch_tokens=512)
    try:
        wait_ready(process, url, log_path)
        with httpx.Client(base_url=url, timeout=60) as client:
            info = client.get("/info").json()
            assert info["models"][0]["outputs"] == ["pooled", "tokens", "colbert", "sparse"], info["models"][0]
            listed = client.get("/v1/models").json()["data"]
            assert listed[0]["outputs"] == ["pooled", "tokens", "colbert", "sparse"], listed
            dense = want["pooled"] / np.linalg.norm(want["pooled"], axis=1, keepdims=True)
            r = client.post("/v1/embeddings", json={"input": TEXTS})
            assert r.status_code == 200, r.text
            assert_embeddings_close([d["embedding"] for d in r.json()["data"]], dense, what="dense")
            # sparse: TEI's entries and OpenAI's sparse encoding, both the head's weights
            for route, body in (("/embed_sparse", {"inputs": TEXTS}),
                                ("/v1/embeddings", {"input": TEXTS, "encoding_format": "sparse"})):
                r = client.post(route, json=body)
                assert r.status_code == 200, (route, r.text)
                entries = r.json() if route == "/embed_sparse" else [d["embedding"] for d in r.json()["data"]]
                got = np.zeros_like(want["sparse"])
                for row, values in enumerate(entries):
                    for entry in values:
                        got[row, entry["index"]] = entry["value"]
                assert_sparse_close(got, want["sparse"], what=route)
            # /embed_all: the multi-vectors, one per token after each input's first
            r = client.post("/embed_all", json={"inputs": TEXTS})
            assert r.status_code == 200, r.text
            split = np.split(want["colbert"], np.cumsum(np.asarray(rows.lengths) - 1)[:-1])
            assert [len(v) for v in r.json()] == [len(v) for v in split]
            for got, theirs in zip(r.json(), split):
                assert_embeddings_close(got, theirs, what="multi-vectors")
            again = client.post("/embed_all", json={"inputs": TEXTS}).json()
            assert_same_rows(np.concatenate(again), np.concatenate(r.json()))
            floats = r.json()
            # several outputs from one forward: each the same as its own request's
            r = client.post("/v1/embeddings", json={"input": TEXTS, "output": ["dense", "multi_vector", "sparse"]})
            assert r.status_code == 200, r.text
            sparse = client.post("/embed_sparse", json={"inputs": TEXTS}).json()
            for item, rows_of, entries in zip(r.json()["data"], floats, sparse):
                assert_same_rows(item["multi_vector"], rows_of)
                assert [e["index"] for e in item["sparse_embedding"]] == [e["index"] for e in entries]
                assert_scores_close([e["value"] for e in item["sparse_embedding"]], [e["value"] for e in entries])
            assert_embeddings_close([d["embedding"] for d in r.json()["data"]], dense, what="dense of several")
            r = client.post("/v1/embeddings", json={"input": TEXTS, "output": ["dense", "sparse"],
                                                    "encoding_format": "base64"})
            assert r.status_code == 422 and r.json()["error"]["param"] == "encoding_format", r.text
            # the same vectors in base64, float32 exactly and float16 rounded; OpenAI's route with output multi_vector
            for encoding, dtype in (("base64", np.float32), ("base64_float16", np.float16)):
                r = client.post("/embed_all", json={"inputs": TEXTS, "encoding_format": encoding})
                assert r.status_code == 200, r.text
                for got, want_rows in zip(r.json(), floats):
                    assert got["shape"] == [len(want_rows), len(want_rows[0])] and got["dtype"] == dtype.__name__
                    assert_same_rows(_decoded(got["data"], dtype, got["shape"]),
                                     np.asarray(want_rows, np.float32).astype(dtype))
                r = client.post("/v1/embeddings", json={"input": TEXTS, "output": "multi_vector",
                                                        "encoding_format": encoding})
                assert r.status_code == 200, r.text
                for item, want_rows in zip(r.json()["data"], floats):
                    assert_same_rows(_decoded(item["embedding"], dtype, item["shape"]),
                                     np.asarray(want_rows, np.float32).astype(dtype))
            r = client.post("/v1/embeddings", json={"input": TEXTS, "output": "multi_vector"})
            assert r.status_code == 200, r.text
            assert_same_rows(np.concatenate([d["embedding"] for d in r.json()["data"]]), np.concatenate(floats))
            # what does not apply is a 422 naming it
            for body, param in (({"input": TEXTS, "encoding_format": "base64_float16"}, "encoding_format"),
                                ({"input": TEXTS, "output": "multi_vector", "encoding_format": "int8"},
                                 "encoding_format"),
                                ({"input": TEXTS, "output": "multi_vector", "dimensions": 8}, "dimensions"),
                                ({"input": TEXTS, "output": "sparse", "encoding_format": "base64"},
                                 "encoding_format")):
                r = client.post("/v1/embeddings", json=body)
                assert r.status_code == 422 and r.json()["error"]["param"] == param, (body, r.text)
    finally:
        stop(process, log_path)


def _decoded(data: str, dtype, shape: list[int]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(data), dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)


def test_a_per_token_answer_over_the_byte_limit_is_a_413_naming_smaller_encodings(tmp_path, expected):
    directory, _, _ = expected
    texts = ["a long enough input for the limit"] * 8
    process, url, log_path = launch(tmp_path, model=str(directory), backend="torch", torch_threads=1,
                                    max_batch_tokens=512, max_response_bytes=40000)
    try:
        wait_ready(process, url, log_path)
        with httpx.Client(base_url=url, timeout=60) as client:
            r = client.post("/embed_all", json={"inputs": texts})
            assert r.status_code == 413, r.text
            assert "max_response_bytes" in r.text and "base64_float16" in r.text, r.text
            r = client.post("/embed_all", json={"inputs": texts, "encoding_format": "base64_float16"})
            assert r.status_code == 200, r.text
            assert len(r.content) <= 40000
    finally:
        stop(process, log_path)


def test_rerank_scores_as_flag_embeddings_compute_score(tmp_path, expected):
    """/rerank and /v1/rerank on BGE-M3: its MaxSim score (the sum over the query's multi-vectors over their count),
    and with weights the weighted dense + sparse + multi-vector score, as FlagEmbedding's compute_score gives them
    one pair at a time (its batches pad the passages' vectors with zeros, a floor of 0 under each query vector's
    maximum that depends on the batch; ours does not)."""
    from FlagEmbedding import BGEM3FlagModel

    directory, _, _ = expected
    query, texts = "late interaction retrieval", ["maxsim scores late interaction", "le chat dort", TEXTS[0]]
    flag = BGEM3FlagModel(str(directory), use_fp16=False, devices="cpu")
    weights = [0.4, 0.2, 0.4]
    want = flag.compute_score([(query, t) for t in texts], batch_size=1, weights_for_different_modes=weights)
    process, url, log_path = launch(tmp_path, model=str(directory), backend="torch", torch_threads=1,
                                    max_batch_tokens=512)
    try:
        wait_ready(process, url, log_path)
        with httpx.Client(base_url=url, timeout=60) as client:
            for body, key in (({}, "colbert"), ({"weights": dict(zip(("dense", "sparse", "colbert"), weights))},
                                                 "colbert+sparse+dense")):
                r = client.post("/rerank", json={"query": query, "texts": texts, **body})
                assert r.status_code == 200, r.text
                got = {item["index"]: item["score"] for item in r.json()}
                assert_scores_close([got[i] for i in range(len(texts))], want[key], "float32", logits=True, what=key)
                assert [item["index"] for item in r.json()] == list(np.argsort(-np.asarray(want[key]), kind="stable"))
                r = client.post("/v1/rerank", json={"query": query, "documents": texts, "top_n": 2, **body})
                assert r.status_code == 200, r.text
                assert [x["index"] for x in r.json()["results"]] == \
                    list(np.argsort(-np.asarray(want[key]), kind="stable"))[:2]
            r = client.post("/rerank", json={"query": query, "texts": texts, "weights": {"dense": 0}})
            assert r.status_code == 422 and "at least one weight" in r.text, r.text
    finally:
        stop(process, log_path)
