"""The real service over HTTP: results, concurrency, the OpenAI and KServe v2 surfaces, errors."""

from __future__ import annotations

import asyncio
import base64
import random

import httpx
import numpy as np
import openai
import pytest
import torch
import tritonclient.http as httpclient
from sentence_transformers import SentenceTransformer

from fusedserve.model.weights import default_model_dir
from tests.model.sentences import SENTENCES
from tests.tolerances import assert_embeddings_close, assert_unit_length


def post(server, path, json=None, **kwargs):
    return httpx.post(server.url + path, json=json, timeout=60, **kwargs)


@pytest.fixture(scope="module")
def st_embeddings():
    st = SentenceTransformer(str(default_model_dir()), device="cpu")
    return torch.from_numpy(st.encode(SENTENCES[:24], convert_to_numpy=True))


def test_infer_matches_sentence_transformers(server, st_embeddings):
    r = post(server, "/infer", {"inputs": SENTENCES[:24]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "all-MiniLM-L6-v2" and body["dim"] == 384 and body["usage"]["tokens"] > 24
    assert_embeddings_close(body["embeddings"], st_embeddings)


def test_single_string_and_options(server):
    one = post(server, "/infer", {"inputs": "hello world"}).json()
    assert len(one["embeddings"]) == 1
    raw = post(server, "/infer", {"inputs": ["hello world"], "normalize": False}).json()
    v, w = torch.tensor(one["embeddings"][0]), torch.tensor(raw["embeddings"][0])
    assert_unit_length(v)
    assert float(w.norm()) > 1.5  # mean-pooled MiniLM vectors are far from unit length
    assert_embeddings_close(torch.nn.functional.normalize(w, dim=0), v)


def test_64_concurrent_clients_get_their_own_results(server):
    """Mixed lengths and request sizes at once: every answer equals that input's single-request result."""
    rng = random.Random(0)
    requests = [[rng.choice(SENTENCES) for _ in range(rng.randint(1, 4))] for _ in range(64)]
    singles = {t: torch.tensor(post(server, "/infer", {"inputs": [t]}).json()["embeddings"][0])
               for t in {t for r in requests for t in r}}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(client.post("/infer", json={"inputs": r}) for r in requests))

    responses = asyncio.run(run())
    for texts, response in zip(requests, responses):
        assert response.status_code == 200, response.text
        got = torch.tensor(response.json()["embeddings"])
        assert got.shape == (len(texts), 384)
        for text, row in zip(texts, got):
            assert_embeddings_close(row, singles[text], what=text)


def test_openai_client(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    texts = ["A man is eating food.", "東京は日本の首都です。"]
    result = client.embeddings.create(input=texts, model="all-MiniLM-L6-v2")  # base64 on the wire
    ours = post(server, "/infer", {"inputs": texts}).json()["embeddings"]
    assert_embeddings_close([item.embedding for item in result.data], ours)
    short = client.embeddings.create(input=texts, model="all-MiniLM-L6-v2", dimensions=64, encoding_format="float")
    v = np.array(short.data[0].embedding)
    assert v.shape == (64,)
    assert_unit_length(v)  # truncated, then normalized again
    assert result.usage.prompt_tokens > 4


def test_openai_token_ids_and_base64(server):
    ids = [[101, 7592, 2088, 102], [101, 7592, 102]]
    r = post(server, "/v1/embeddings", {"input": ids, "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    vec = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype=np.float32)
    text = post(server, "/infer", {"inputs": ["hello world"]}).json()["embeddings"][0]
    assert_embeddings_close(vec, text)  # same ids as the text
    assert post(server, "/v1/embeddings", {"input": [101, 30522, 102]}).status_code == 422
    assert post(server, "/v1/embeddings", {"input": "x", "dimensions": 0}).status_code == 400
    assert post(server, "/v1/embeddings", {"input": "x", "model": "gpt-9"}).status_code == 404


def test_kserve_v2(server):
    name = "all-MiniLM-L6-v2"
    assert httpx.get(f"{server.url}/v2/health/live").json() == {"live": True}
    assert httpx.get(f"{server.url}/v2/health/ready").status_code == 200
    meta = httpx.get(f"{server.url}/v2/models/{name}").json()
    assert meta["inputs"][0]["datatype"] == "BYTES" and meta["outputs"][0]["shape"] == [-1, 384]
    assert httpx.get(f"{server.url}/v2/models/{name}/ready").json()["ready"] is True
    texts = ["A man is eating food.", "hi"]
    body = {"id": "req-7", "inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": texts}]}
    # no JSON content type on purpose: OIP clients may omit it
    r = httpx.post(f"{server.url}/v2/models/{name}/infer", content=__import__("json").dumps(body), timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"] == "req-7" and out["outputs"][0]["shape"] == [2, 384] and out["outputs"][0]["datatype"] == "FP32"
    got = torch.tensor(out["outputs"][0]["data"]).view(2, 384)
    assert_embeddings_close(got, post(server, "/infer", {"inputs": texts}).json()["embeddings"])
    assert httpx.get(f"{server.url}/v2/models/other").status_code == 404
    bad = {"inputs": [{"name": "text", "shape": [3], "datatype": "BYTES", "data": texts}]}
    assert post(server, f"/v2/models/{name}/infer", bad).status_code == 400


@pytest.mark.parametrize("send,status", [
    (lambda s: httpx.post(s.url + "/infer", content=b"{not json", headers={"content-type": "application/json"}), 400),
    (lambda s: post(s, "/infer", {"inputs": 5}), 422),
    (lambda s: post(s, "/infer", {"inputs": [1, 2]}), 422),
    (lambda s: post(s, "/infer", {}), 422),
    (lambda s: post(s, "/infer", {"inputs": []}), 400),
    (lambda s: post(s, "/infer", {"inputs": ["x"] * 257}), 413),
    (lambda s: post(s, "/infer", {"inputs": ["word " * 600], "truncate": False}), 413),
    (lambda s: httpx.post(s.url + "/infer", content=b"{" + b" " * (5 << 20) + b"}",
                          headers={"content-type": "application/json"}, timeout=60), 413),
    # the hot routes parse their own bodies (server.responses.LeanRoute) the way FastAPI does:
    (lambda s: httpx.post(s.url + "/infer", content=b'{"inputs": ["a"]}', headers={"content-type": "text/plain"}),
     422),  # not a JSON content type: the raw bytes fail validation
    (lambda s: httpx.post(s.url + "/v1/embeddings", content=b"", headers={"content-type": "application/json"}), 422),
    (lambda s: post(s, "/v1/embeddings", [1, 2]), 422),  # JSON, but not an object
    (lambda s: httpx.post(s.url + "/v1/embeddings", content=b'{"input": [1, 2', headers={}), 422),  # no type: bytes
    (lambda s: httpx.get(s.url + "/nope"), 404),
    (lambda s: httpx.get(s.url + "/infer"), 405),
])
def test_bad_input_gets_json_4xx_and_server_keeps_serving(server, send, status):
    r = send(server)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] and error["message"]
    assert "Traceback" not in r.text and "/work/" not in r.text
    assert post(server, "/infer", {"inputs": ["still serving"]}).status_code == 200


def test_info_and_health(server):
    info = httpx.get(server.url + "/info").json()
    assert info["model"] == "all-MiniLM-L6-v2" and info["device"] == "cpu" and info["dtype"] == "float32"
    # on the CPU the GEMM blocks run on the CPU backend and the ops it lacks on the reference
    assert info["kernels"]["linear_add_layer_norm"]["backend"] == "cpu"
    assert info["kernels"]["embedding_layer_norm"]["backend"] == "torch"
    assert "needs a CUDA device" in info["kernels"]["linear_add_layer_norm"]["rejected"]["triton"]
    assert info["batching"]["max_batch_tokens"] == 2048
    assert httpx.get(server.url + "/healthz").json() == {"status": "ok"}
    assert httpx.get(server.url + "/readyz").status_code == 200
    assert "/infer" in httpx.get(server.url + "/openapi.json").json()["paths"]


def test_tritonclient_http(server, st_embeddings):
    client = httpclient.InferenceServerClient(url=server.url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("all-MiniLM-L6-v2")
    texts = SENTENCES[:4]
    tensor = httpclient.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_), binary_data=False)
    output = httpclient.InferRequestedOutput("embedding", binary_data=False)
    result = client.infer("all-MiniLM-L6-v2", [tensor], outputs=[output])
    got = torch.from_numpy(result.as_numpy("embedding"))
    assert got.shape == (4, 384)
    assert_embeddings_close(got, st_embeddings[:4])


def test_hot_routes_take_json_content_types_and_report_errors_under_body(server):
    """POST /infer and /v1/embeddings read JSON under application/json (with parameters, any case) and
    application/*+json, and refuse a body without a JSON content type (FastAPI's strict default); a validation error
    names its field under "body", as FastAPI's own handler does."""
    for content_type, status in (("application/json; charset=utf-8", 200), ("Application/JSON", 200),
                                 ("application/vnd.api+json", 200), (None, 422), ("text/json", 422)):
        headers = {"content-type": content_type} if content_type else {}
        for path, body in (("/infer", b'{"inputs": ["a"]}'), ("/v1/embeddings", b'{"input": "a"}')):
            r = httpx.post(server.url + path, content=body, headers=headers, timeout=60)
            assert r.status_code == status, (content_type, path, r.text)
    r = post(server, "/infer", {"inputs": "a", "normalize": "yes please"})
    assert r.status_code == 422 and r.json()["error"]["message"].startswith("body.normalize: ")
