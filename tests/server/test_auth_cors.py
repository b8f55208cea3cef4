"""API keys and CORS on the real server: every API route wants `Authorization: Bearer <key>` (401 with
WWW-Authenticate, in each protocol's error shape, and each protocol's client passes its key), the probes, the scrape
and the docs stay open, and browsers from an allowed origin get CORS headers, preflights included."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import openai
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from fusedserve.server.app import create_app
from fusedserve.server.config import Settings
from tests.server.conftest import start_server

KEYS = ("key-one", "key-two")
ORIGIN = "https://app.example"
MODEL = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("auth"), api_keys=",".join(KEYS), cors_allow_origins=ORIGIN)
    yield srv
    srv.stop()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_inference_needs_a_key(server):
    body = {"inputs": ["hello"]}
    for headers in ({}, bearer("nope"), {"Authorization": f"Basic {KEYS[0]}"}, bearer(KEYS[0] + "x")):
        r = httpx.post(server.url + "/infer", json=body, headers=headers, timeout=60)
        assert r.status_code == 401, (headers, r.text)
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert r.json()["error"]["type"] == "unauthorized"
    for key in KEYS:
        assert httpx.post(server.url + "/infer", json=body, headers=bearer(key), timeout=60).status_code == 200
    assert httpx.get(server.url + "/info").status_code == 401
    assert httpx.get(server.url + "/info", headers=bearer(KEYS[1])).json()["model"] == MODEL


def test_each_protocol_answers_401_in_its_shape(server):
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "a"}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(server.url + "/embed", json={"inputs": "a"}, timeout=60)
    assert r.status_code == 401 and r.json() == {"error": r.json()["error"], "error_type": "unauthorized"}
    r = httpx.get(server.url + f"/v2/models/{MODEL}")
    assert r.status_code == 401 and isinstance(r.json()["error"], str)


def test_probes_metrics_and_docs_stay_open(server):
    for path in ("/healthz", "/readyz", "/metrics", "/health", "/v2/health/live", "/v2/health/ready", "/docs",
                 "/redoc", "/openapi.json", "/docs/assets/swagger-ui.css"):
        assert httpx.get(server.url + path).status_code == 200, path
    schema = httpx.get(server.url + "/openapi.json").json()  # Swagger UI's Authorize button takes a key
    assert schema["security"] == [{"apiKey": []}]
    assert schema["components"]["securitySchemes"]["apiKey"] == {"type": "http", "scheme": "bearer",
                                                                 "description": "one of FUSEDSERVE_API_KEYS"}


def test_clients_pass_their_keys(server, monkeypatch):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[0], max_retries=0)
    assert len(client.embeddings.create(input="hello", model=MODEL).data[0].embedding) == 384
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


    triton = httpclient.InferenceServerClient(url=server.url.removeprefix("http://"))
    tensor = httpclient.InferInput("text", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([b"hello"], dtype=np.object_))
    with pytest.raises(InferenceServerException, match="API key"):
        triton.infer(MODEL, [tensor])
    assert triton.infer(MODEL, [tensor], headers=bearer(KEYS[1])).as_numpy("embedding").shape == (1, 384)

    import huggingface_hub
    from huggingface_hub import InferenceClient

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # see test_tei.hf_client
    assert InferenceClient(model=server.url, token=KEYS[0]).feature_extraction("hello").shape == (1, 384)


def test_cors(server):
    preflight = httpx.options(server.url + "/v1/embeddings", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200  # no key needed for a preflight
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    r = httpx.post(server.url + "/infer", json={"inputs": "a"}, headers={"Origin": ORIGIN, **bearer(KEYS[0])},
                   timeout=60)
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in r.headers["access-control-expose-headers"]
    # an origin not configured gets no CORS grant (its browser blocks the answer)
    other = httpx.post(server.url + "/infer", json={"inputs": "a"},
                       headers={"Origin": "https://evil.example", **bearer(KEYS[0])}, timeout=60)
    assert "access-control-allow-origin" not in other.headers


def test_probes_need_a_key_when_configured():
    """auth_probes: /healthz, /readyz, /metrics, ... want a key too (in-process: the model is not needed)."""
    app = create_app(Settings(api_keys=["k"], auth_probes=True))

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return [(await client.get(path, headers=headers)).status_code
                    for path in ("/healthz", "/metrics") for headers in ({}, bearer("k"))]

    assert asyncio.run(run()) == [401, 200, 401, 200]
    open_app = create_app(Settings(api_keys=["k"]))

    async def run_open():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=open_app), base_url="http://test") as client:
            return (await client.get("/healthz")).status_code, (await client.post("/infer", json={})).status_code

    assert asyncio.run(run_open()) == (200, 401)
