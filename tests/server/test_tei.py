"""The text-embeddings-inference API on the real server: huggingface_hub's InferenceClient pointed at it, curl for
/embed, /tokenize and /decode, and TEI's request and response shapes (token-id inputs, truncation direction,
per-token output, errors)."""

from __future__ import annotations

import json
import shutil
import subprocess

import httpx
import numpy as np
import pytest

from tests.model.sentences import SENTENCES
from tests.tolerances import assert_embeddings_close, assert_same_rows, assert_scores_close, assert_unit_length

MODEL = "all-MiniLM-L6-v2"


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


def infer(server, texts, **options) -> np.ndarray:
    r = post(server, "/infer", {"inputs": texts, **options})
    assert r.status_code == 200, r.text
    return np.array(r.json()["embeddings"], dtype=np.float32)


def curl(server, path: str, body: dict):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    out = subprocess.run(["curl", "-sS", "-f", f"{server.url}{path}", "-H", "content-type: application/json",
                          "-d", json.dumps(body)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture
def hf_client(monkeypatch):
    """huggingface_hub's InferenceClient class. The suite runs huggingface_hub offline (tests/conftest.py), which
    blocks every request its session makes, this server's on 127.0.0.1 too; a URL model never reaches the Hub."""
    import huggingface_hub
    from huggingface_hub import InferenceClient

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    return InferenceClient


def test_inference_client_feature_extraction(server, hf_client):
    InferenceClient = hf_client

    client = InferenceClient(model=server.url)  # a URL: requests go to POST / with TEI's parameters
    texts = SENTENCES[:3]
    got = client.feature_extraction(texts)
    assert got.dtype == np.float32 and got.shape == (3, 384)
    assert_same_rows(got, infer(server, texts))  # /infer's request through TEI's route: the same rows
    raw = client.feature_extraction(texts[0], normalize=False, truncate=True, truncation_direction="right")
    assert_same_rows(raw, infer(server, [texts[0]], normalize=False))
    short = client.feature_extraction(texts[0], dimensions=32)
    assert short.shape == (1, 32)
    assert_unit_length(short)
    with pytest.raises(Exception, match="prompt_name"):  # MiniLM has no prompts: refused, never ignored
        client.feature_extraction(texts[0], prompt_name="query")


def test_inference_client_sentence_similarity_and_health(server, hf_client):
    InferenceClient = hf_client

    scores = InferenceClient(model=server.url).sentence_similarity(SENTENCES[0], SENTENCES[1:4])
    vectors = infer(server, SENTENCES[:4])
    assert_scores_close(scores, vectors[1:] @ vectors[0], what="cosine similarity")
    # the client's request, as JSON: the same scores
    assert post(server, "/similarity", {"inputs": {"source_sentence": SENTENCES[0], "sentences": SENTENCES[1:4]}}
                ).json() == list(scores)
    assert InferenceClient(model=server.url, provider="hf-inference").health_check()
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.content == b""


def test_curl_embed(server):
    texts = ["A man is eating food.", "hello"]
    got = np.array(curl(server, "/embed", {"inputs": texts}), dtype=np.float32)
    assert_same_rows(got, infer(server, texts))
    # POST / answers as /embed does (the default route of a TEI server serving an embedding model); one input alone
    assert_embeddings_close(curl(server, "/", {"inputs": texts[1]}), got[1:], what="POST /")


def test_curl_tokenize(server):
    tokens = curl(server, "/tokenize", {"inputs": "héllo wörld"})
    assert len(tokens) == 1
    assert [t["id"] for t in tokens[0]] == [101, 7592, 2088, 102]
    cls, first, second, sep = tokens[0]
    assert cls == {"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None}
    assert sep["special"] and sep["start"] is None
    # start/stop are UTF-8 byte offsets into the input, as TEI reports them; text is the input's own text
    assert first == {"id": 7592, "text": "héllo", "special": False, "start": 0, "stop": 6}
    assert second == {"id": 2088, "text": "wörld", "special": False, "start": 7, "stop": 13}
    raw = "héllo wörld".encode()
    assert raw[second["start"]: second["stop"]].decode() == "wörld"
    bare = curl(server, "/tokenize", {"inputs": ["a b", "c"], "add_special_tokens": False})
    assert [[t["special"] for t in row] for row in bare] == [[False, False], [False]]


def test_curl_decode(server):
    assert curl(server, "/decode", {"ids": [101, 7592, 2088, 102]}) == ["hello world"]
    assert curl(server, "/decode", {"ids": [[101, 7592, 102], [2088]], "skip_special_tokens": False}) == \
        ["[CLS] hello [SEP]", "world"]


def test_token_ids_and_mixed_inputs(server):
    ids = [101, 7592, 2088, 102]  # "hello world"
    text = infer(server, ["hello world"])
    assert_same_rows(post(server, "/embed", {"inputs": ids}).json(), text)  # the text's own ids: the same row
    mixed = post(server, "/embed", {"inputs": ["hi", ids, "hello world"]}).json()
    assert_embeddings_close(mixed[1:], [text[0], text[0]], what="in a batch of three")


def test_truncation(server):
    long_text = "alpha " * 300 + "omega"
    right = np.array(post(server, "/embed", {"inputs": long_text}).json())
    left = np.array(post(server, "/embed", {"inputs": long_text, "truncation_direction": "left"}).json())
    # right keeps the start ("alpha ..."), left the end ("... omega")
    # each the same ids as the shorter text (256 tokens with [CLS] and [SEP]): the same row
    assert_same_rows(right, infer(server, ["alpha " * 254]), what="right")
    assert_same_rows(left, infer(server, ["alpha " * 253 + "omega"]), what="left")
    r = post(server, "/embed", {"inputs": long_text, "truncate": False})
    assert r.status_code == 413 and r.json()["error_type"] == "validation" and "256" in r.json()["error"]


def test_embed_all_is_the_per_token_output(server):
    rows = post(server, "/embed_all", {"inputs": ["hello world", "a longer input sentence"]}).json()
    assert [len(r) for r in rows] == [4, 6] and all(len(t) == 384 for r in rows for t in r)
    # mean pooling of the per-token states is the (unnormalized) sentence embedding
    pooled = infer(server, ["hello world", "a longer input sentence"], normalize=False)
    for tokens, expected in zip(rows, pooled):
        # both scaled by the embedding's length: the table bounds embeddings of unit length, these are not normalized
        length = np.linalg.norm(expected)
        assert_embeddings_close(np.mean(tokens, axis=0) / length, expected / length, what="mean of the tokens")


def test_tei_errors_and_strict_flags(server):
    for body in ({"inputs": "a", "normalize": "yes"}, {"inputs": "a", "truncate": 1}, {"inputs": 5}):
        r = post(server, "/embed", body)
        assert r.status_code == 422, r.text
        assert set(r.json()) == {"error", "error_type"} and r.json()["error_type"] == "validation"
    r = post(server, "/embed", {"inputs": "a", "prompt_name": "query"})
    assert r.status_code == 422 and "prompt_name" in r.json()["error"]
    assert post(server, "/tokenize", {"inputs": "a", "add_special_tokens": "no"}).status_code == 422
    assert httpx.get(server.url + "/embed").json()["error_type"] == "validation"  # 405, TEI's shape


def test_embed_sparse_errors_are_in_tei_shape(server):
    """/embed_sparse is TEI's route: its errors read as TEI's do, `{"error", "error_type"}`."""
    for body in ({"inputs": ["a"]}, {"inputs": 5}, {"inputs": "a", "truncate": 1}):
        r = post(server, "/embed_sparse", body)
        assert r.status_code == 422 and set(r.json()) == {"error", "error_type"}, r.text
        assert isinstance(r.json()["error"], str) and r.json()["error_type"] == "validation", r.text


def test_a_dense_model_refuses_embed_sparse(server):
    """/embed_sparse serves sparse (SPLADE) models only, and OpenAI's sparse encoding_format likewise: the dense
    default model refuses both, naming the way (a SPLADE model's answers: tests/server/test_sparse_http.py)."""
    texts = ["A man is eating food.", "Sparse lexical vectors for retrieval."]
    r = post(server, "/embed_sparse", {"inputs": texts})
    assert r.status_code == 422 and "serves sparse models" in r.text and "/embed" in r.text
    r = post(server, "/v1/embeddings", {"input": texts, "encoding_format": "sparse"})
    assert r.status_code == 422 and "sparse" in r.text
