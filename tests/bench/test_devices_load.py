"""`python -m bench serve devices` end to end on the CPU, two fake GPUs (the test server's TEST_FAKE_GPUS hook: each
fake device's workers run on the CPU under its name): it must be ready for the two-GPU machine's one call. It asserts
the results' structure and the fault case's accounting, never a speed."""

from __future__ import annotations

import sys

import pytest

from bench import devices_load
from bench import results as store
from bench.__main__ import main
from bench.harness import ServerLaunch


@pytest.fixture
def fake_gpus(monkeypatch):
    monkeypatch.setenv("TEST_FAKE_GPUS", "cuda:0,cuda:1")
    monkeypatch.setattr(devices_load, "LAUNCH", ServerLaunch((sys.executable, "-m", "tests.support.server")))


@pytest.mark.slow
def test_every_gpu_against_one_and_a_device_killed_under_load(tmp_path, fake_gpus):
    out = tmp_path / "serve.json"
    assert main(["serve", "devices", "--device", "cpu", "--model", "tiny", "--setting", "torch_threads=1",
                 "--setting", "max_batch_tokens=2048", "--seconds", "1.5", "--warm-seconds", "0.3", "--texts", "64",
                 "--max-words", "12", "--client-processes", "2", "--devices-points", "4x2",
                 "--fault-point", "4x2", "--fault-seconds", "45", "--fault-after", "2", "--log-dir", str(tmp_path),
                 "--out", str(out)]) == 0
    doc = store.load(out)
    assert store.validate(doc) == []
    block = doc["scenarios"]["devices"]
    assert block["complete"] and block["settings"]["points"] == ["4x2"]
    rows, summary = block["results"], block["summary"]
    assert summary["gpus"] == ["cuda:0", "cuda:1"]
    assert [(r["config"], r["point"]) for r in rows] == [("every GPU", "4x2"), ("one GPU", "4x2")]
    every, one = rows
    # WORKERS=auto on fake GPUs: the placement the server made, as /info and the metrics said it
    assert set(every["workers"]) == {"cuda:0", "cuda:1"} and set(one["workers"]) == {"cuda:0"}
    assert one["server_cpus"] <= every["server_cpus"]
    for row in rows:
        assert row["errors"] == 0 and row["requests"] > 0 and row["tokens_per_s"] > 0
        assert set(row["devices"]) == set(row["workers"])
        assert sum(d["tokens_share"] for d in row["devices"].values()) == pytest.approx(1.0)
        assert all(d["busy"] >= 0 for d in row["devices"].values())
    assert any(d["busy"] > 0 for d in every["devices"].values())
    assert "tiny 4x2" in summary["scaling"] and summary["scaling"]["tiny 4x2"]["ratio"] > 0

    fault = summary["fault"]
    assert fault["device"] == "cuda:1" and fault["killed_workers"] == every["workers"]["cuda:1"]
    # no answer is another text's; the device came back (a replacement answered) and the other kept serving
    assert fault["wrong"] == 0 and fault["answered"] > 0
    # a replacement's start competes with the load's clients for a loaded 2-core machine's cores: the bound is
    # generous; a worker that never comes back still fails (rejoin_s None)
    assert fault["rejoin_s"] is not None and 0 < fault["rejoin_s"] < 40
    assert fault["workers_after"] == fault["workers_before"]
    assert fault["answered_while_out"] > 0
    # a failed request is one the killed workers held (or a connection to a socket dying with them): a handful
    assert fault["failed"] <= 4 and len(fault["failed_after_kill_s"]) == fault["failed"]
