"""Several models in one server (FUSEDSERVE_MODELS), through the real clients: the packaged MiniLM (the default), a
tiny XLM-R embedding model and a cross-encoder, each answering on its routes with what sentence-transformers computes
for it alone; requests pick a model by name (OpenAI's `model`, KServe's path, /v1/rerank's `model`), and without one
go to the first model of their route's kind; an unknown name is a 404 naming the models, a route of the other kind a
422; /v1/models, /info and /metrics show each model; the admin switch, the verifier and the kernel timer work per
model; concurrent requests to the models never get each other's answers. Then the fail policy: by default a model
that fails to load stops the start naming it; with model_load_failure=skip the others serve and it is reported."""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import openai
import pytest
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from sentence_transformers import CrossEncoder, SentenceTransformer
from tritonclient.utils import InferenceServerException

from fusedserve.model.weights import default_model_dir
from tests.model import checkpoints
from tests.server.conftest import admin_headers, start_server
from tests.tolerances import assert_embeddings_close, assert_scores_close

NAMES = ["minilm", "xlmr", "reranker"]
TEXTS = ["A man is eating food.", "Fused kernels make encoders fast.", "x"]
QUERY = "how do fused kernels make an encoder fast?"
DOCUMENTS = ["They cut the memory traffic between ops.", "Cats sleep most of the day.", "Fewer launches per layer."]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The three model directories (MiniLM's is the packaged one) and their reference libraries."""
    root = tmp_path_factory.mktemp("models")
    xlmr = checkpoints.tiny_xlm_roberta(root / "xlmr")
    reranker = checkpoints.cross_encoder(root / "reranker", 1)
    return {"paths": {"minilm": "default", "xlmr": str(xlmr), "reranker": str(reranker)},
            "minilm": SentenceTransformer(str(default_model_dir()), device="cpu"),
            "xlmr": SentenceTransformer(str(xlmr), device="cpu"),
            "reranker": CrossEncoder(str(reranker), device="cpu")}


@pytest.fixture(scope="module")
def multi(models, tmp_path_factory):
    """One server of the three models, every batch checked by the verifier and timed op by op."""
    spec = ",".join(f"{name}={models['paths'][name]}" for name in NAMES)
    server = start_server(tmp_path_factory.mktemp("multi"), models=spec, verify_sample_rate=1.0,
                          kernel_timing_sample_rate=1.0)
    yield server
    server.stop()


def _infer(server, texts, model=None) -> httpx.Response:
    body = {"inputs": texts, **({"model": model} if model is not None else {})}
    return httpx.post(server.url + "/infer", json=body, timeout=60)


def test_each_model_answers_on_its_routes_as_served_alone(multi, models):
    expected = {name: models[name].encode(TEXTS, normalize_embeddings=True) for name in ("minilm", "xlmr")}
    for name, want in expected.items():
        r = _infer(multi, TEXTS, name)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == name and r.json()["dim"] == want.shape[1]
        assert_embeddings_close(r.json()["embeddings"], want, what=f"/infer {name}")
    # no model named: the first embedding model; TEI's /embed (no model field) too
    r = _infer(multi, TEXTS)
    assert r.json()["model"] == "minilm"
    assert_embeddings_close(r.json()["embeddings"], expected["minilm"], what="/infer unnamed")
    assert_embeddings_close(httpx.post(multi.url + "/embed", json={"inputs": TEXTS}, timeout=60).json(),
                            expected["minilm"], what="/embed")
    # the re-ranker: Cohere-style by name and unnamed (the first classifier), TEI's /rerank (no model field)
    ranked = models["reranker"].rank(QUERY, DOCUMENTS)
    for body in ({"model": "reranker"}, {}):
        r = httpx.post(multi.url + "/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS, **body}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "reranker"
        assert [x["index"] for x in r.json()["results"]] == [e["corpus_id"] for e in ranked]
        # fp32 on the CPU against CrossEncoder on the same weights
        assert_scores_close([x["relevance_score"] for x in r.json()["results"]], [e["score"] for e in ranked],
                            what=f"/v1/rerank {body}")
    scores = models["reranker"].predict([(QUERY, d) for d in DOCUMENTS])
    tei = httpx.post(multi.url + "/rerank", json={"query": QUERY, "texts": DOCUMENTS}, timeout=60).json()
    assert_scores_close([x["score"] for x in tei], [scores[x["index"]] for x in tei], what="/rerank")


def test_openai_client_picks_the_model_by_name(multi, models):
    client = openai.OpenAI(base_url=multi.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == NAMES
    assert client.models.retrieve("xlmr").id == "xlmr"
    for name in ("minilm", "xlmr"):
        result = client.embeddings.create(input=TEXTS, model=name)  # base64 on the wire, decoded by the client
        assert result.model == name
        assert_embeddings_close([d.embedding for d in result.data], models[name].encode(TEXTS,
                                                                                        normalize_embeddings=True))
    with pytest.raises(openai.NotFoundError) as error:
        client.embeddings.create(input="x", model="text-embedding-3-small")
    body = error.value.body
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert all(repr(name) in body["message"] for name in ["text-embedding-3-small", *NAMES]), body["message"]
    with pytest.raises(openai.UnprocessableEntityError) as error:  # an embedding route on the classifier
        client.embeddings.create(input="x", model="reranker")
    assert "reranker is a classifier model" in error.value.body["message"]


def test_tritonclient_infers_on_each_embedding_model(multi, models):
    client = httpclient.InferenceServerClient(url=multi.url.removeprefix("http://"))
    assert client.is_server_ready() and all(client.is_model_ready(name) for name in NAMES)
    for name in ("minilm", "xlmr"):
        tensor = httpclient.InferInput("text", [len(TEXTS)], "BYTES")
        tensor.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=np.object_))
        result = client.infer(name, [tensor])
        assert result.get_response()["model_name"] == name
        assert_embeddings_close(result.as_numpy("embedding"), models[name].encode(TEXTS, normalize_embeddings=True))
        dim = models[name].get_embedding_dimension()
        assert client.get_model_metadata(name)["outputs"][0]["shape"] == [-1, dim]
    assert client.get_model_metadata("reranker")["parameters"]["kind"] == "classifier"
    tensor = httpclient.InferInput("text", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([b"x"], dtype=np.object_))
    with pytest.raises(InferenceServerException) as error:
        client.infer("reranker", [tensor])
    assert error.value.status() == "422" and "classifier" in error.value.message()
    with pytest.raises(InferenceServerException) as error:
        client.infer("nope", [tensor])
    assert error.value.status() == "404" and "'minilm', 'xlmr', 'reranker'" in error.value.message()


def test_unknown_models_and_routes_of_the_other_kind(multi):
    r = _infer(multi, "x", "nope")
    assert r.status_code == 404 and r.json()["error"]["message"] == \
        "model 'nope' is not served here; this server serves 'minilm', 'xlmr', 'reranker'"
    r = _infer(multi, "x", "reranker")
    assert r.status_code == 422 and "reranker is a classifier model" in r.json()["error"]["message"]
    r = httpx.post(multi.url + "/v1/rerank", json={"model": "xlmr", "query": "q", "documents": ["a"]})
    assert r.status_code == 422 and "xlmr is an embedding model" in r.json()["error"]["message"]
    r = httpx.post(multi.url + "/v1/rerank", json={"model": "nope", "query": "q", "documents": ["a"]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_info_lists_every_model_with_its_memory(multi, models):
    info = httpx.get(multi.url + "/info").json()
    assert info["model"] == "minilm" and info["dim"] == 384  # the top level: the default model, as before
    entries = {e["model"]: e for e in info["models"]}
    assert list(entries) == NAMES
    assert entries["xlmr"]["kind"] == "embedding" and entries["xlmr"]["dim"] == 64
    assert entries["reranker"]["kind"] == "classifier" and entries["reranker"]["labels"] == ["score"]
    assert entries["xlmr"]["path"] == models["paths"]["xlmr"]
    for e in entries.values():
        assert e["status"] == "ready" and e["device"] == "cpu" and e["kernels"]
        # fp32 parameters (and the verifier's fp32 copy of them) on the device
        assert e["memory"]["parameters_bytes"] > 0 and e["memory"]["reference_copy_bytes"] == \
            e["memory"]["parameters_bytes"]
    # the weights the reference libraries hold (an embedding model's unused pooler left out), in fp32
    held = {"minilm": models["minilm"].named_parameters(), "xlmr": models["xlmr"].named_parameters(),
            "reranker": models["reranker"].model.named_parameters()}
    for name, parameters in held.items():
        expected = 4 * sum(p.numel() for n, p in parameters if name == "reranker" or "pooler" not in n)
        assert entries[name]["memory"]["parameters_bytes"] == expected, name
    report = multi.log()
    report = report[report.index("fusedserve: ready in "):]
    assert "serving as minilm: model all-MiniLM-L6-v2: 6 layers" in report  # named otherwise than its checkpoint
    assert "model xlmr: 2 layers, hidden 64" in report and "model reranker: 6 layers" in report, report
    assert report.count("memory on cpu: parameters ") == 3


def _samples(server) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(server.url + "/metrics").text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_metrics_verify_and_kernel_timing_per_model(multi):
    for name in ("minilm", "xlmr"):
        assert _infer(multi, [f"counted by {name}"], name).status_code == 200
    assert httpx.post(multi.url + "/predict", json={"inputs": ["a", "b", "c"]}, timeout=60).status_code == 200
    deadline = time.monotonic() + 30  # the verifier checks in the background
    while time.monotonic() < deadline:
        samples = _samples(multi)
        if all(_value(samples, "fusedserve_reference_checks_total", model=n, result="match") >= 1 for n in NAMES) \
                and all(_value(samples, "fusedserve_kernel_duration_seconds_count", model=n, op="embedding_layer_norm",
                               backend="torch") >= 1 for n in NAMES):  # ops timed after the answer, when idle
            break
        time.sleep(0.1)
    for name in NAMES:
        assert _value(samples, "fusedserve_reference_checks_total", model=name, result="match") >= 1, name
        assert _value(samples, "fusedserve_reference_checks_total", model=name, result="mismatch") == 0, name
        assert _value(samples, "fusedserve_batch_size_count", model=name) >= 1, name
        assert _value(samples, "fusedserve_kernel_duration_seconds_count", model=name, op="embedding_layer_norm",
                      backend="torch") >= 1, name
        assert _value(samples, "fusedserve_backend_info", model=name, op="linear_bias_gelu", backend="cpu") == 1
        assert _value(samples, "fusedserve_model_ready", model=name) == 1
    assert _value(samples, "fusedserve_requests_total", model="xlmr", route="/infer", status="200") >= 1
    assert _value(samples, "fusedserve_requests_total", model="reranker", route="/predict", status="200") == 1


def test_the_fused_switch_per_model_and_for_all(multi):
    r = httpx.post(multi.url + "/admin/fused", json={"enabled": False, "model": "xlmr"}, headers=admin_headers(),
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "xlmr" and list(r.json()["models"]) == ["xlmr"] and r.json()["fused"] is False
    fused = {e["model"]: e["fused"] for e in httpx.get(multi.url + "/info").json()["models"]}
    assert fused == {"minilm": True, "xlmr": False, "reranker": True}
    assert _value(_samples(multi), "fusedserve_fused_enabled", model="xlmr") == 0
    r = httpx.post(multi.url + "/admin/fused", json={"enabled": True}, headers=admin_headers(), timeout=60)
    assert r.status_code == 200 and list(r.json()["models"]) == NAMES
    assert all(e["fused"] for e in httpx.get(multi.url + "/info").json()["models"])


def test_concurrent_requests_to_the_models_get_their_own_answers(multi):
    """Interleaved requests to the three models, each input its own text: every answer is what that model gives that
    input alone (a batched answer equals the single one)."""
    texts = [f"sentence {i} about {topic}" for i, topic in enumerate(["cats", "kernels", "rivers", "tea"] * 3)]
    alone = {name: np.array(_infer(multi, texts, name).json()["embeddings"]) for name in ("minilm", "xlmr")}
    scores = {texts[r["index"]]: r["relevance_score"] for r in httpx.post(
        multi.url + "/v1/rerank", json={"query": QUERY, "documents": texts}, timeout=60).json()["results"]}

    async def burst():
        async with httpx.AsyncClient(base_url=multi.url, timeout=60) as client:
            calls = []
            for i, text in enumerate(texts):
                calls.append(client.post("/infer", json={"inputs": [text], "model": "minilm"}))
                calls.append(client.post("/v1/embeddings", json={"input": text, "model": "xlmr",
                                                                 "encoding_format": "float"}))
                calls.append(client.post("/v1/rerank", json={"query": QUERY, "documents": [text]}))
            return await asyncio.gather(*calls)

    responses = asyncio.run(burst())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    for i, text in enumerate(texts):
        minilm, xlmr, rerank = responses[3 * i: 3 * i + 3]
        assert minilm.json()["model"] == "minilm" and xlmr.json()["model"] == "xlmr"
        assert_embeddings_close(minilm.json()["embeddings"], alone["minilm"][i: i + 1], what=f"minilm {text}")
        assert_embeddings_close([xlmr.json()["data"][0]["embedding"]], alone["xlmr"][i: i + 1], what=f"xlmr {text}")
        assert_scores_close(rerank.json()["results"][0]["relevance_score"], scores[text], what=f"reranker {text}")


# ---- the fail policy -----------------------------------------------------------------------------------------
def test_a_model_that_fails_to_load_stops_the_start_by_default(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    with pytest.raises(RuntimeError) as error:
        start_server(tmp_path, models=f"tiny=tiny,broken={missing}", max_batch_tokens=512)
    log = str(error.value)
    assert log.startswith("server exited with 1"), log[-3000:]
    assert f"start-up failed: model 'broken' ({missing})" in log, log[-3000:]


def test_skip_serves_the_others_and_reports_the_failed_model(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    server = start_server(tmp_path, models=f"broken={missing},tiny=tiny", model_load_failure="skip",
                          max_batch_tokens=512)
    try:
        ready = httpx.get(server.url + "/readyz").json()
        assert ready["status"] == "ready" and str(missing) in ready["failed"]["broken"], ready
        entries = {e["model"]: e for e in httpx.get(server.url + "/info").json()["models"]}
        assert entries["broken"]["status"] == "failed" and str(missing) in entries["broken"]["error"]
        assert entries["tiny"]["status"] == "ready"
        r = _infer(server, "x", "broken")
        assert r.status_code == 503 and "model 'broken' failed to load" in r.json()["error"]["message"]
        assert str(missing) in r.json()["error"]["message"]
        assert _infer(server, "x", "tiny").status_code == 200
        # unnamed: the first model failed, and the request may have meant it, so it is not sent to another one
        r = _infer(server, "x")
        assert r.status_code == 503 and "name one of 'tiny'" in r.json()["error"]["message"]
        assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == ["tiny"]
        assert _value(_samples(server), "fusedserve_model_ready", model="broken") == 0
        assert "FAILED to load, skipped" in server.log()
    finally:
        server.stop()


def test_skip_still_stops_when_no_model_loads(tmp_path):
    with pytest.raises(RuntimeError) as error:
        start_server(tmp_path, models=f"a={tmp_path / 'none-a'},b={tmp_path / 'none-b'}", model_load_failure="skip")
    assert str(error.value).startswith("server exited with 1") and "no model loaded" in str(error.value)
