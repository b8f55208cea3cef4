"""A tiny BGE-M3 directory served (tests/model/checkpoints.bge_m3), in one process and through FRONTENDS=1's engine:
/v1/embeddings and /embed give its dense vectors, /embed_sparse and /v1/embeddings' sparse encoding its sparse head's
weights, /embed_all its multi-vectors (one per token after the first); /info and /v1/models list the outputs. Each answer equals
the model's own output for the same rows (tests/model/test_bge_m3.py holds those to FlagEmbedding), and the two
process models answer alike."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from fusedserve.model import load
from fusedserve.model.api import LoadOptions, TextOptions
from tests.model import checkpoints
from tests.server.test_startup import launch, stop, wait_ready
from tests.tolerances import assert_embeddings_close, assert_same_rows, assert_sparse_close

pytestmark = pytest.mark.slow

TEXTS = ["a man is eating food", "multi-vector retrieval scores by maxsim", "le chat dort"]


@pytest.fixture(scope="module")
def expected(tmp_path_factory):
    directory = checkpoints.bge_m3(tmp_path_factory.mktemp("bge-m3"))
    model = load(str(directory), LoadOptions(device="cpu", dtype="float32"))
    rows = model.prepare(TEXTS, TextOptions())
    outputs = {output: model.launch(rows, output=output).rows() for output in ("pooled", "colbert", "sparse")}
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
    finally:
        stop(process, log_path)
