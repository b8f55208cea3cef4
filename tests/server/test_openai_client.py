"""The OpenAI surface with the real `openai` client: models, embeddings in every encoding it knows (float, and
base64, its default on the wire), `dimensions`, `truncate`, and errors in OpenAI's shape."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from tests.tolerances import assert_embeddings_close, assert_same_rows, assert_unit_length

MODEL = "all-MiniLM-L6-v2"
TEXTS = ["A man is eating food.", "東京は日本の首都です。"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def infer(server, texts) -> np.ndarray:
    return np.array(httpx.post(server.url + "/infer", json={"inputs": texts}, timeout=60).json()["embeddings"])


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model" and model.owned_by == "fusedserve" and model.created > 0
    with pytest.raises(openai.NotFoundError) as error:
        client.models.retrieve("gpt-9")
    assert error.value.body["code"] == "model_not_found" and "gpt-9" in error.value.body["message"]


def test_embeddings_float_base64_dimensions(client, server):
    expected = infer(server, TEXTS)
    default = client.embeddings.create(input=TEXTS, model=MODEL)  # the client asks for base64 and decodes it
    as_float = client.embeddings.create(input=TEXTS, model=MODEL, encoding_format="float")
    for result, encoding in ((default, "base64"), (as_float, "float")):
        assert [d.index for d in result.data] == [0, 1]
        # the inputs of /infer's request, so the same rows, and either encoding carries float32 exactly
        assert_same_rows([d.embedding for d in result.data], expected, what=encoding)
        assert result.model == MODEL and result.usage.prompt_tokens == result.usage.total_tokens > 4
    short = client.embeddings.create(input=TEXTS[0], model=MODEL, dimensions=64, user="someone")
    v = np.array(short.data[0].embedding)
    assert v.shape == (64,)
    assert_unit_length(v)
    # one input alone (another batch than /infer's two), its first 64 dimensions renormalized
    assert_embeddings_close(v, expected[0, :64] / np.linalg.norm(expected[0, :64]), what="dimensions=64")


def test_truncate(client):
    long_text = "word " * 600
    assert client.embeddings.create(input=long_text, model=MODEL).usage.prompt_tokens == 256
    with pytest.raises(openai.APIStatusError) as error:
        client.embeddings.create(input=long_text, model=MODEL, extra_body={"truncate": False})
    assert error.value.status_code == 413 and "256" in error.value.body["message"]
    ids = [101] + [2088] * 300 + [102]
    assert client.embeddings.create(input=[ids], model=MODEL).usage.prompt_tokens == 256
    with pytest.raises(openai.APIStatusError):
        client.embeddings.create(input=[ids], model=MODEL, extra_body={"truncate": False})


def test_errors_in_openai_shape(client, server):
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(input="x", model=MODEL, dimensions=0)
    assert error.value.body == {"message": "dimensions must be between 1 and 384", "type": "invalid_request_error",
                                "param": "dimensions", "code": "invalid_request"}
    with pytest.raises(openai.NotFoundError) as error:
        client.embeddings.create(input="x", model="text-embedding-3-small")
    assert error.value.body["param"] == "model" and error.value.body["code"] == "model_not_found"
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "x", "truncate": "false"}, timeout=60)
    assert r.status_code == 422
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == "truncate"
