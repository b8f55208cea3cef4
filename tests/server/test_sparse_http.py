"""A SPLADE model served by a real server: TEI's POST /embed_sparse and OpenAI's /v1/embeddings with encoding_format
"sparse" (through the real openai client) answer SparseEncoder.encode's vectors on the same directory (fp32 CPU), as
[{index, value}] lists; the dense routes refuse a sparse model, naming the way (and /embed_sparse a dense one: the
default model's server, tests/server/test_tei.py)."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
from sentence_transformers import SparseEncoder

from tests.model import checkpoints
from tests.server.conftest import start_server
from tests.tolerances import assert_sparse_close

TEXTS = ["A man is eating food.", "Sparse lexical vectors for retrieval.", "x"]
VOCABULARY = 30522


def _dense(entries: list[list[dict]]) -> np.ndarray:
    out = np.zeros((len(entries), VOCABULARY), dtype=np.float32)
    for row, items in zip(out, entries):
        indices = [e["index"] for e in items]
        assert indices == sorted(indices) and len(set(indices)) == len(indices)
        assert all(e["value"] > 0 for e in items)
        row[indices] = [e["value"] for e in items]
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = checkpoints.splade(tmp_path_factory.mktemp("model") / "splade")
    server = start_server(tmp_path_factory.mktemp("server"), model=str(path))
    expected = SparseEncoder(str(path), device="cpu").encode(TEXTS, convert_to_tensor=True).to_dense().numpy()
    yield server, expected
    server.stop()


def test_embed_sparse_and_openai_sparse_match_sparse_encoder(served):
    server, expected = served
    r = httpx.post(server.url + "/embed_sparse", json={"inputs": TEXTS}, timeout=60)
    assert r.status_code == 200, r.text
    tei = _dense(r.json())
    assert_sparse_close(tei, expected, what="/embed_sparse")
    one = httpx.post(server.url + "/embed_sparse", json={"inputs": TEXTS[0]}, timeout=60).json()
    assert len(one) == 1 and one[0] == r.json()[0]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    result = client.embeddings.create(input=TEXTS, model="splade", encoding_format="sparse")
    rows = _dense([[dict(e) for e in d.embedding] for d in result.data])
    assert np.array_equal(rows, tei)  # the same batch, the same rows
    assert result.usage.prompt_tokens > len(TEXTS)
    info = httpx.get(server.url + "/info").json()
    assert info["kind"] == "sparse" and info["dim"] == VOCABULARY


def test_routes_of_the_other_kind_refuse_naming_the_way(served):
    server, _ = served
    for route, body in (("/embed", {"inputs": TEXTS}), ("/v1/embeddings", {"input": TEXTS}),
                        ("/infer", {"inputs": TEXTS})):
        r = httpx.post(server.url + route, json=body, timeout=60)
        assert r.status_code == 422 and "sparse model" in r.text and "/embed_sparse" in r.text, (route, r.text)
    r = httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS, "encoding_format": "sparse",
                                                        "dimensions": 8})
    assert r.status_code == 422 and "dimensions" in r.text
