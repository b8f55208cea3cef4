"""The seam (fusedserve.model.api): the server package uses a model only through ServedModel's members. A real app
(an embedding model and a cross-encoder, every route, the verifier with its fallback, sampled kernel timing, the
fused switch, shutdown) runs against models wrapped in a recorder: every member the server reaches is one of
api.MEMBERS, and every member of the protocol is used by the server (none is dead weight)."""

from __future__ import annotations

import sys
import time

import pytest
from fastapi.testclient import TestClient

from fusedserve.kernels import fp8
from fusedserve.model import api
from fusedserve.server import model_service
from fusedserve.server.config import Settings
from tests.model import checkpoints
from tests.support.server import create_test_app

TOKEN = "seam-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


class Recorder:
    """A model as the server sees it: each member code of the fusedserve.server package reaches is written down, then
    handed over (the test-only fault hook reaches past the seam on purpose: it is not the server). What a member
    returns that is a model too (reference_copy) is recorded the same way."""

    def __init__(self, model, used: set[str]) -> None:
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_used", used)

    def __getattr__(self, name: str):
        if sys._getframe(1).f_globals.get("__name__", "").startswith("fusedserve.server"):
            self._used.add(name)
        value = getattr(self._model, name)
        if name == "reference_copy":
            return lambda: Recorder(value(), self._used)
        return value

    def __setattr__(self, name: str, value) -> None:
        raise AssertionError(f"the server set {name!r} on a model")


@pytest.fixture(scope="module")
def used(tmp_path_factory, monkeypatch_module) -> set[str]:
    members: set[str] = set()
    # the fused backends are rejected on the CPU as in a real server (the suite's Triton interpreter is for kernel tests)
    monkeypatch_module.delenv("TRITON_INTERPRET", raising=False)
    # PRECISION=fp8 on this CPU (torch._scaled_mm runs here; the capability check stands in for an FP8 GPU), held to a
    # tolerance no FP8 batch meets: the verifier's sustained mismatches take the fallback tier first
    monkeypatch_module.setattr(fp8, "unavailable", lambda device: None)
    real_load = model_service.load
    monkeypatch_module.setattr(model_service, "load", lambda path, options: Recorder(real_load(path, options),
                                                                                      members))
    reranker = checkpoints.cross_encoder(tmp_path_factory.mktemp("seam") / "reranker", 1)
    settings = Settings(models=f"tiny=tiny,reranker={reranker}", device="cpu", max_batch_tokens=512,
                        verify_sample_rate=1.0, verify_action="fallback", kernel_timing_sample_rate=1.0,
                        admin_token=TOKEN, precision="fp8", verify_tolerance_fp8=1e-9)
    app = create_test_app(settings)  # with the test-only fault hook, to make the verifier see a mismatch
    with TestClient(app) as client:
        deadline = time.monotonic() + 300
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, client.get("/readyz").json()
            time.sleep(0.1)  # polls readiness with a deadline
        calls = [
            ("post", "/infer", {"inputs": ["a first text", "and a second one"]}),
            ("post", "/infer", {"inputs": "quantized", "encoding_format": "int8"}),
            ("post", "/v1/embeddings", {"input": [[101, 2023, 102]], "dimensions": 8}),
            ("post", "/embed", {"inputs": ["left cut", [101, 102]], "truncation_direction": "Left"}),
            ("post", "/embed_all", {"inputs": "per token"}),
            ("post", "/tokenize", {"inputs": "tokens and offsets"}),
            ("post", "/decode", {"ids": [101, 7592, 102]}),
            ("post", "/similarity", {"inputs": {"source_sentence": "a", "sentences": ["a", "b"]}}),
            ("post", "/v2/models/tiny/infer",
             {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["kserve"]}]}),
            ("post", "/rerank", {"query": "q", "texts": ["a", "b"]}),
            ("post", "/predict", {"inputs": ["a", "b"]}),
            ("get", "/info", None),
            ("get", "/metrics", None),
        ]
        for method, path, body in calls:
            r = client.request(method, path, json=body)
            assert r.status_code == 200, (path, r.text)
        assert client.get("/info").json()["precision"]["requested"] == "fp8"
        deadline = time.monotonic() + 60
        while client.get("/info").json()["precision"]["active"] == "fp8":
            assert time.monotonic() < deadline, "the verifier never took the FP8 fallback tier"
            client.post("/infer", json={"inputs": "one more"})
        assert client.get("/info").json()["fallback"] is None  # the tier is not the reference fallback
        # a fault the verifier sees moves the first model to the reference, between batches
        r = client.post("/admin/faults", json={"op": "linear_bias_gelu", "mode": "scale", "factor": 3.0},
                        headers=ADMIN)
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 60
        while client.get("/info").json()["fallback"] is None:
            assert time.monotonic() < deadline, "the verifier never fell back"
            client.post("/infer", json={"inputs": "one more"})
        r = client.post("/admin/fused", json={"enabled": True}, headers=ADMIN)
        assert r.status_code == 200, r.text
    return members


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_the_server_uses_only_the_protocol(used):
    assert used <= set(api.MEMBERS), f"the server reached past the seam: {sorted(used - set(api.MEMBERS))}"


def test_every_member_of_the_protocol_is_used(used):
    assert set(api.MEMBERS) <= used, f"members the server never uses: {sorted(set(api.MEMBERS) - used)}"


def test_the_protocol_lists_its_members():
    declared = {name for name in vars(api.ServedModel) if not name.startswith("_")}
    assert declared == set(api.MEMBERS)
