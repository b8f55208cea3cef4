"""The `cpu` scenario's peer plumbing at a tiny size (the packaged MiniLM, 4 texts, one round): every row with texts/s
and CPU ms per text and their spread, or with the reason it could not run; the peer process spoken to over its pipe;
the server's CPU counted over its process tree. It asserts structure and counts, never a rate."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

import pytest
import torch

from bench import cpu_peers
from bench import results as store
from bench.__main__ import main
from bench.harness import min_cosine
from fusedserve.model.weights import default_model_dir

TEXTS = ["a short sentence", "another one, a little longer than the first", "three words here", "and a fourth"]
SPREAD = ("texts_per_s", "cpu_ms_per_text")


def _openvino_here() -> bool:
    """openvino and optimum-intel import in the test environment (the OpenVINO rows then run on this interpreter)."""
    return importlib.util.find_spec("openvino") is not None and importlib.util.find_spec("optimum") is not None \
        and importlib.util.find_spec("optimum.intel") is not None


def _assert_spread(row: dict, rounds: int) -> None:
    assert len(row["rounds"]) == rounds
    for key in SPREAD:
        assert row[f"{key}_min"] <= row[key] <= row[f"{key}_max"] and row[f"{key}_min"] > 0


def test_the_cpu_scenario_reports_every_row_or_why_not(tmp_path):
    """One server configuration (one start keeps the test short) and the bfloat16 row, measured or saying why; the
    in-process peers; the OpenVINO rows on this interpreter where it imports openvino, else their reason (the
    interpreter given does not exist: the scenario must say so, not leave the rows out)."""
    out = tmp_path / "serve.json"
    openvino = sys.executable if _openvino_here() else str(tmp_path / "no-such-python")
    assert main(["serve", "cpu", "--device", "cpu", "--setting", "torch_threads=1", "--texts", "4", "--max-words",
                 "12", "--seconds", "1", "--rounds", "1", "--one-text-count", "3", "--per-request", "2",
                 "--cpu-configs", "fp32", "--openvino-python", openvino, "--log-dir", str(tmp_path),
                 "--out", str(out)]) == 0
    doc = store.load(out)
    assert store.validate(doc) == []
    block = doc["scenarios"]["cpu"]
    summary = block["summary"]
    assert block["complete"] and summary["sentence_transformers_one_text"]["p50_ms"] > 0
    assert block["settings"]["openvino"]["requirements"] == list(cpu_peers.OPENVINO_REQUIREMENTS)

    (fp32,) = block["results"]
    assert fp32["dtype"] == "float32" and fp32["attention"] == "varlen" and fp32["errors"] == 0
    assert fp32["min_cosine"] > 0.99999 and fp32["one_text"]["p50_ms"] > 0 and fp32["ready_s"] > 0
    assert 0 <= fp32["client_cpu_share"] < 1 and fp32["client_cpu_ms_per_text"] >= 0
    assert fp32["config"] == "fp32" and fp32["cpu_isa"] == torch.backends.cpu.get_cpu_capability()
    _assert_spread(fp32, 1)
    (point,) = fp32["rounds"]
    assert point["texts"] == 2 * point["requests"] and point["server_cpu_s"] > 0

    # every peer is a measured row or a reason, never both, never neither
    names = ["sentence-transformers", "sentence-transformers onnx", *cpu_peers.OPENVINO_PEERS]
    for name in names:
        assert (name in summary["peers"]) != (name in summary["unavailable"]), name
    st = summary["peers"]["sentence-transformers"]
    assert st["backend"] == "torch" and st["vs_sentence_transformers"] == 1 and st["min_cosine"] > 0.99999
    assert fp32["vs_sentence_transformers"] == pytest.approx(fp32["texts_per_s"] / st["texts_per_s"])
    for name, row in summary["peers"].items():
        _assert_spread(row, 1)
        assert row["min_cosine"] > 0.999 and row["load_s"] > 0
    if _openvino_here():
        for name, model_kwargs in cpu_peers.OPENVINO_PEERS.items():
            row = summary["peers"][name]
            assert row["backend"] == "openvino" and row["model_kwargs"] == model_kwargs
            assert row["properties"]["INFERENCE_PRECISION_HINT"]
        assert summary["peers"]["sentence-transformers openvino f32"]["properties"]["INFERENCE_PRECISION_HINT"] \
            == "f32"
    else:
        for name in cpu_peers.OPENVINO_PEERS:
            assert "no-such-python: no such interpreter" in summary["unavailable"][name]


def test_the_peer_process_answers_over_its_pipe(tmp_path):
    """The worker the OpenVINO peer runs in, here on this interpreter with the torch backend: the corpus once, a
    timed pass over it, vectors as sentence-transformers gives them in this process, an error as an answer."""
    from sentence_transformers import SentenceTransformer

    log = str(tmp_path / "worker.log")
    process = cpu_peers.PeerProcess(sys.executable, log)
    try:
        assert process.call(op="texts", texts=TEXTS) == {"texts": 4}
        about = process.call(op="load", name="torch", path=str(default_model_dir()), backend="torch",
                             model_kwargs={})
        assert about["load_s"] > 0 and about["properties"] == {} and about["versions"]["sentence-transformers"]
        peer = cpu_peers.ProcessPeer(process, "torch", about)
        timed = peer.rate()
        assert timed["seconds"] > 0 and timed["cpu_s"] >= 0
        here = SentenceTransformer(str(default_model_dir()), device="cpu").encode(TEXTS).tolist()
        assert min_cosine(peer.vectors(TEXTS), here) > 0.99999
        with pytest.raises(RuntimeError, match="KeyError"):
            process.call(op="rate", name="not loaded")
        assert process.call(op="texts", texts=TEXTS[:1]) == {"texts": 1}  # still answering after an error
    finally:
        process.close()
    assert process.process.returncode == 0


def test_the_server_cpu_counts_its_process_tree():
    """A child burning CPU while this process sleeps: its seconds are in this process's tree."""
    before, own = cpu_peers._tree_cpu_s(os.getpid()), time.process_time()
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time\nwhile t() < 0.3: pass\n"
                                                    "time.sleep(60)"])
    try:
        deadline = time.monotonic() + 30
        while cpu_peers._tree_cpu_s(os.getpid()) - before - (time.process_time() - own) < 0.25:
            assert time.monotonic() < deadline, "the child's CPU time never showed in the tree"
            time.sleep(0.1)
    finally:
        child.kill()
        child.wait()


def test_the_cpu_scenario_skips_bfloat16_saying_why_on_a_cpu_without_it(monkeypatch):
    from fusedserve.model import loading

    monkeypatch.setattr(loading, "cpu_flags", lambda: frozenset({"avx2", "fma", "sse4_2"}))
    reason = cpu_peers._supported("bfloat16")
    assert reason.startswith("not measurable on this CPU") and "amx_bf16, avx512_bf16" in reason
    assert "(its vector flags: avx2, fma)" in reason
    assert cpu_peers._supported("fp32") is cpu_peers._supported("workers-2") is None
