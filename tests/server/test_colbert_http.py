"""A ColBERT model in PyLate's layout served (tests/model/checkpoints.colbert, the golden "bert" variant), in one
process and through FRONTENDS=1's engine: /embed_all and /v1/embeddings (output multi_vector) give PyLate's query and
document vectors (prompt_name "query" or "document"; queries by default, as PyLate's encode), /rerank and /v1/rerank
score by MaxSim with the query encoded as a query and the texts as documents, and the dense routes refuse it by
name. The vectors and scores are those of tests/model/golden/pylate.json, which tests/model/test_colbert.py holds
the model to."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.model import checkpoints
from tests.server.test_startup import launch, stop, wait_ready
from tests.tolerances import assert_embeddings_close, assert_scores_close

GOLDEN = json.loads((Path(__file__).resolve().parents[1] / "model" / "golden" / "pylate.json").read_text())
VARIANT = GOLDEN["variants"]["bert"]


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return checkpoints.colbert(tmp_path_factory.mktemp("colbert") / "bert", **VARIANT["builder"])


@pytest.mark.parametrize("frontends", [0, 1])
def test_colbert_served(tmp_path, directory, frontends):
    process, url, log_path = launch(tmp_path, model=str(directory), frontends=frontends, backend="torch",
                                    torch_threads=1, max_batch_tokens=512)
    try:
        wait_ready(process, url, log_path)
        with httpx.Client(base_url=url, timeout=60) as client:
            assert client.get("/v1/models").json()["data"][0]["outputs"] == ["tokens", "colbert"]
            for key, role in (("queries", "query"), ("documents", "document")):
                texts = GOLDEN[key]
                r = client.post("/embed_all", json={"inputs": texts, "prompt_name": role})
                assert r.status_code == 200, r.text
                for text, got, want in zip(texts, r.json(), VARIANT[key]):
                    assert len(got) == len(want["vectors"]), (role, text)
                    assert_embeddings_close(got, want["vectors"], what=f"{role} {text!r}")
                r = client.post("/v1/embeddings", json={"input": texts, "prompt_name": role, "output": "multi_vector"})
                assert r.status_code == 200, r.text
                for got, want in zip(r.json()["data"], VARIANT[key]):
                    assert_embeddings_close(got["embedding"], want["vectors"], what=role)
            # no prompt_name: queries, as PyLate's encode(is_query=True)
            r = client.post("/embed_all", json={"inputs": GOLDEN["queries"][:1]})
            assert_embeddings_close(r.json()[0], VARIANT["queries"][0]["vectors"], what="default role")
            # /rerank: MaxSim of each candidate, best first, as PyLate's scores over the real tokens
            for q, candidates in enumerate(GOLDEN["candidates"]):
                texts = [GOLDEN["documents"][d] for d in candidates]
                want = np.asarray([VARIANT["scores_unpadded"][q][d] for d in candidates])
                r = client.post("/rerank", json={"query": GOLDEN["queries"][q], "texts": texts, "truncate": True})
                assert r.status_code == 200, r.text
                got = {item["index"]: item["score"] for item in r.json()}
                assert_scores_close([got[i] for i in range(len(texts))], want, "float32", logits=True,
                                    what=f"query {q}")
                assert [item["index"] for item in r.json()] == list(np.argsort(-want, kind="stable"))
                r = client.post("/v1/rerank", json={"query": GOLDEN["queries"][q], "documents": texts, "top_n": 1})
                assert r.status_code == 200, r.text
                assert r.json()["results"][0]["index"] == int(np.argmax(want))
            # what does not apply is refused by name
            r = client.post("/v1/embeddings", json={"input": ["dense?"]})
            assert r.status_code == 422 and "multi-vectors only" in r.text, r.text
            r = client.post("/rerank", json={"query": "q", "texts": ["d"], "weights": {"dense": 1}})
            assert r.status_code == 422 and "MaxSim alone" in r.text, r.text
            r = client.post("/embed_all", json={"inputs": ["a [MASK] inside"]})
            assert r.status_code in (400, 413, 422) and "[MASK]" in r.text, r.text
    finally:
        stop(process, log_path)
