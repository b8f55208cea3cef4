"""The models users bring, through the HTTP routes of a real server: each answer equals sentence-transformers'
SentenceTransformer on the same directory (fp32 CPU), prompts included (named per request, or the model's default),
and Matryoshka truncation (`dimensions`) as its truncate_dim gives it."""

from __future__ import annotations

import httpx
import pytest
from sentence_transformers import SentenceTransformer

from tests.model import checkpoints
from tests.server.conftest import start_server
from tests.tolerances import assert_embeddings_close

TEXTS = ["A man is eating food.", "Fused kernels make encoders fast.", "x"]
PROMPTS = {"query": "query: ", "passage": "passage: "}


def _agree(rows, expected) -> None:
    assert_embeddings_close(rows, expected)  # fp32 on the CPU against the reference library on the same weights


# nomic-embed-text's task prefixes are prompts of its sentence-transformers configuration
NOMIC_PROMPTS = {"query": "search_query: ", "passage": "search_document: "}


@pytest.fixture(scope="module", params=["minilm-cls-dense-prompts", "xlm-roberta", "distilbert-max", "nomic_bert"])
def served(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("model")
    path = {
        "minilm-cls-dense-prompts": lambda: checkpoints.minilm(root / "m", ["cls"], dense=[(384, 96, "tanh")],
                                                               prompts=PROMPTS, default_prompt="query"),
        "xlm-roberta": lambda: checkpoints.tiny_xlm_roberta(root / "x", prompts=PROMPTS),
        "distilbert-max": lambda: checkpoints.tiny_distilbert(root / "d", ["max"]),
        "nomic_bert": lambda: checkpoints.nomic_bert(root / "n", prompts=NOMIC_PROMPTS,
                                                     default_prompt="query"),
    }[request.param]()
    server = start_server(tmp_path_factory.mktemp("server"), model=str(path))
    yield request.param, server, SentenceTransformer(str(path), device="cpu")
    server.stop()


def test_infer_and_openai_embeddings_match_sentence_transformers(served):
    name, server, reference = served
    expected = reference.encode(TEXTS, normalize_embeddings=True)
    r = httpx.post(server.url + "/infer", json={"inputs": TEXTS}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["dim"] == expected.shape[1]
    _agree(r.json()["embeddings"], expected)  # the model's default prompt where it has one, as encode() applies it
    r = httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS}, timeout=60)
    _agree([d["embedding"] for d in r.json()["data"]], expected)


def test_named_prompts_per_request(served):
    name, server, reference = served
    if name == "distilbert-max":  # no prompts of its own: a name is refused (text-embeddings-inference's behaviour;
        # sentence-transformers would take "query" as an empty prompt)
        r = httpx.post(server.url + "/infer", json={"inputs": TEXTS, "prompt_name": "query"})
        assert r.status_code == 422 and "prompt_name" in r.text
        return
    for prompt in PROMPTS:
        expected = reference.encode(TEXTS, prompt_name=prompt, normalize_embeddings=True)
        _agree(httpx.post(server.url + "/infer", json={"inputs": TEXTS, "prompt_name": prompt}).json()["embeddings"],
               expected)
        data = httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS, "prompt_name": prompt}).json()["data"]
        _agree([d["embedding"] for d in data], expected)
        _agree(httpx.post(server.url + "/embed", json={"inputs": TEXTS, "prompt_name": prompt}).json(), expected)
    r = httpx.post(server.url + "/infer", json={"inputs": TEXTS, "prompt_name": "nope"})
    assert r.status_code == 422 and "'nope' is not one of this model's prompts" in r.text


def test_matryoshka_dimensions_match_truncate_dim(served, tmp_path):
    name, server, reference = served
    if name != "nomic_bert":  # one model is enough: the truncation is the model's output, whatever the family
        pytest.skip("checked on nomic_bert")
    expected = reference.encode(TEXTS, prompt_name="passage", truncate_dim=16, normalize_embeddings=True)
    r = httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS, "dimensions": 16, "prompt_name": "passage"})
    assert r.status_code == 200, r.text
    _agree([d["embedding"] for d in r.json()["data"]], expected)
