"""What a new user meets first, in one in-process app on the tiny preset: the model's name from the start (/readyz
while loading, /v1/models, a request naming it), the start-up report as an info line, and unknown request fields
(a 422 naming the field on /infer and /v1/embeddings; ignored on the TEI and KServe routes, as those servers do)."""

from __future__ import annotations

import logging
import time

import pytest
from fastapi.testclient import TestClient

from fusedserve.server.app import create_app
from fusedserve.server.config import ModelSpec, Settings
from fusedserve.server.metrics import Metrics
from fusedserve.server.model_service import ModelService
from fusedserve.server.service import Service


def test_a_model_is_named_before_it_loads():
    metrics = Metrics()
    assert ModelService(Settings(), metrics, None, ModelSpec(path="default")).name == "all-MiniLM-L6-v2"
    assert ModelService(Settings(), metrics, None, ModelSpec(path="tiny")).name == "tiny"
    assert ModelService(Settings(), metrics, None, ModelSpec(path="/models/ce/")).name == "ce"
    assert ModelService(Settings(), metrics, "mine", ModelSpec(path="tiny")).name == "mine"


def test_readyz_names_the_model_while_it_loads():
    service = Service(Settings(model="default"))
    service.loading = model = service.models[0]
    model.phase = "loading"
    assert service.readiness()["model"] == "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def client(monkeypatch_module):
    monkeypatch_module.delenv("TRITON_INTERPRET", raising=False)  # the CPU's reference path, as a real server
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(level=logging.DEBUG)
    logger = logging.getLogger("fusedserve")
    logger.addHandler(handler)
    previous = logger.level
    logger.setLevel(logging.INFO)
    try:
        with TestClient(create_app(Settings(model="tiny", device="cpu", max_batch_tokens=512))) as c:
            deadline = time.monotonic() + 120
            while c.get("/readyz").status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.05)  # polls readiness with a deadline
            c.records = records
            yield c
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_the_preset_is_served_under_its_own_name(client):
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny"]
    r = client.post("/infer", json={"inputs": "hello", "model": "tiny"})
    assert r.status_code == 200 and r.json()["model"] == "tiny"


def test_the_start_up_report_is_an_info_line(client):
    ready = [r for r in client.records if r.getMessage().startswith("ready in ")]
    assert len(ready) == 1 and ready[0].levelno == logging.INFO
    assert "(random init)" in ready[0].getMessage()  # the report says what the preset is


@pytest.mark.parametrize("path, body", [
    ("/infer", {"inputs": "hello", "normalise": False}),
    ("/v1/embeddings", {"input": "hello", "encodingformat": "float"}),
])
def test_an_unknown_field_is_a_422_naming_it(client, path, body):
    r = client.post(path, json=body)
    assert r.status_code == 422
    unknown = next(k for k in body if k not in ("inputs", "input"))
    assert unknown in r.text


@pytest.mark.parametrize("path, body", [
    ("/embed", {"inputs": "hello", "normalise": False}),
    ("/v2/models/tiny/infer", {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hi"]}],
                               "priority": 1}),
])
def test_tei_and_kserve_routes_ignore_unknown_fields(client, path, body):
    assert client.post(path, json=body).status_code == 200
