"""Classifiers over HTTP: a cross-encoder served by the real server answers text-embeddings-inference's /rerank
and /predict and the Cohere/Jina-style /v1/rerank with sentence-transformers' CrossEncoder's scores on the same
directory; an embedding route on a classifier (and the reverse) is a clear 4xx naming what the model serves."""

from __future__ import annotations

import httpx
import pytest
import torch
from sentence_transformers import CrossEncoder

from tests.model import checkpoints
from tests.server.conftest import start_server
from tests.tolerances import assert_scores_close

QUERY = "how do fused kernels make an encoder fast?"
TEXTS = ["They cut the memory traffic between ops.", "Cats sleep most of the day.", "Fewer kernel launches per layer.",
         ""]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    path = checkpoints.cross_encoder(tmp_path_factory.mktemp("ce") / "reranker", 1)
    server = start_server(tmp_path_factory.mktemp("server"), model=str(path))
    yield server, CrossEncoder(str(path), device="cpu")
    server.stop()


@pytest.fixture(scope="module")
def nli(tmp_path_factory):
    path = checkpoints.cross_encoder(tmp_path_factory.mktemp("ce") / "nli", 3)
    server = start_server(tmp_path_factory.mktemp("server"), model=str(path))
    yield server, CrossEncoder(str(path), device="cpu")
    server.stop()


def test_tei_rerank_matches_cross_encoder(reranker):
    server, reference = reranker
    expected = reference.predict([(QUERY, t) for t in TEXTS])
    r = httpx.post(server.url + "/rerank", json={"query": QUERY, "texts": TEXTS, "return_text": True}, timeout=60)
    assert r.status_code == 200, r.text
    ranked = r.json()
    assert [x["index"] for x in ranked] == sorted(range(len(TEXTS)), key=lambda i: -expected[i])
    assert [x["text"] for x in ranked] == [TEXTS[x["index"]] for x in ranked]
    # fp32 on the CPU against the reference library on the same weights
    assert_scores_close([x["score"] for x in ranked], [expected[x["index"]] for x in ranked])
    raw = httpx.post(server.url + "/rerank", json={"query": QUERY, "texts": TEXTS, "raw_scores": True}).json()
    logits = reference.predict([(QUERY, t) for t in TEXTS], activation_fn=torch.nn.Identity())
    assert_scores_close([x["score"] for x in raw], [logits[x["index"]] for x in raw], logits=True)
    assert all("text" not in x for x in raw)


def test_v1_rerank_cohere_shape(reranker):
    server, reference = reranker
    expected = reference.rank(QUERY, TEXTS)
    r = httpx.post(server.url + "/v1/rerank", json={"query": QUERY, "documents": [TEXTS[0], {"text": TEXTS[1]},
                                                                                  *TEXTS[2:]],
                                                    "top_n": 2, "return_documents": True}, timeout=60)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == [e["corpus_id"] for e in expected[:2]]
    assert_scores_close([x["relevance_score"] for x in results], [e["score"] for e in expected[:2]])
    assert [x["document"] for x in results] == [{"text": TEXTS[x["index"]]} for x in results]


def test_predict_single_pair_and_batch(nli):
    server, reference = nli
    pairs = [(QUERY, t) for t in TEXTS[:3]]
    expected = reference.predict(pairs, apply_softmax=True)
    labels = ["contradiction", "entailment", "neutral"]
    one = httpx.post(server.url + "/predict", json={"inputs": list(pairs[0])}, timeout=60).json()
    assert [x["label"] for x in one] == [labels[j] for j in (-expected[0]).argsort(kind="stable")]
    assert_scores_close([x["score"] for x in one], [expected[0][labels.index(x["label"])] for x in one])
    batch = httpx.post(server.url + "/predict", json={"inputs": [list(p) for p in pairs]}).json()
    assert len(batch) == 3 and [x["label"] for x in batch[0]] == [x["label"] for x in one]
    # the pair in a batch of three against it alone
    assert_scores_close([x["score"] for x in batch[0]], [x["score"] for x in one], what="in a batch")
    # one label per model: /rerank needs a re-ranker
    r = httpx.post(server.url + "/rerank", json={"query": QUERY, "texts": TEXTS})
    assert r.status_code == 422 and "has 3 labels" in r.text


def test_routes_of_the_other_kind_answer_4xx_naming_the_model(nli, server):
    classifier, _ = nli
    r = httpx.post(classifier.url + "/infer", json={"inputs": "x"})
    assert r.status_code == 422 and "classifier" in r.text, r.text
    r = httpx.post(server.url + "/rerank", json={"query": "q", "texts": ["a"]})  # the default embedding model
    assert r.status_code == 422 and "embedding model" in r.text, r.text
    r = httpx.post(server.url + "/predict", json={"inputs": "x"})
    assert r.status_code == 422 and "embedding model" in r.text
    r = httpx.post(classifier.url + "/predict", json={"inputs": [["a", "b", "c"]]})
    assert r.status_code == 422


def test_v1_rerank_usage_counts_the_tokens_of_every_pair(reranker):
    """`usage.total_tokens` is the tokens the model ran: each (query, document) pair as the model's tokenizer joins it,
    special tokens included, for every document scored, not only the `top_n` returned."""
    server, reference = reranker
    pairs = reference.tokenizer([QUERY] * len(TEXTS), TEXTS)
    expected = sum(len(ids) for ids in pairs["input_ids"])
    for top_n in (None, 1):
        r = httpx.post(server.url + "/v1/rerank", json={"query": QUERY, "documents": TEXTS, "top_n": top_n},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"] == {"total_tokens": expected}, top_n
    # one more document, more tokens: the count follows the request
    r = httpx.post(server.url + "/v1/rerank", json={"query": QUERY, "documents": [*TEXTS, "one more"]}, timeout=60)
    more = len(reference.tokenizer(QUERY, "one more")["input_ids"])
    assert r.json()["usage"]["total_tokens"] == expected + more
