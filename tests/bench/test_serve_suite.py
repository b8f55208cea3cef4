"""`python -m bench serve` end to end against real servers on 127.0.0.1 (tiny preset, CPU): each scenario writes a
valid block whose counts agree with themselves. It asserts structure and counts, never a rate."""

from __future__ import annotations

import pytest

from bench import results as store
from bench.__main__ import main


@pytest.mark.slow
def test_scenarios_against_real_servers(tmp_path):
    out = tmp_path / "serve.json"
    # the torch backend: the servers skip the Triton self-tests, which on the interpreter take most of a start
    common = ["--device", "cpu", "--model", "tiny", "--setting", "torch_threads=1", "--setting", "backend=torch",
              "--seconds", "1.5",
              "--texts", "48", "--max-words", "12", "--per-request", "2", "--out", str(out)]
    assert main(["serve", "closed-loop", "single", "workers", "replicas", "soak", "startup", "head-of-line", *common,
                 "--gap-ms", "50", "--clients",
                 "4", "--payloads", "text", "ids", "--single-count", "12", "--replica-counts", "2",
                 "--worker-counts", "2", "--replica-clients", "4", "--soak-clients", "8", "--cancel-rate", "0.2", "--first-requests", "8",
                 "--log-dir", str(tmp_path)]) == 0
    doc = store.load(out)
    assert store.validate(doc) == [] and list(doc["scenarios"]) == ["closed-loop", "head-of-line", "replicas",
                                                                 "single", "soak", "startup", "workers"]
    assert all(b["complete"] for b in doc["scenarios"].values())

    loop = doc["scenarios"]["closed-loop"]
    assert loop["summary"]["runner_raw_tokens_per_s"] > 0
    assert loop["summary"]["sentence_transformers_tokens_per_s"] is None  # a random-init preset has no ST checkpoint
    assert [(r["payload"], r["clients"]) for r in loop["results"]] == [("text", 4), ("ids", 4)]
    for r in loop["results"]:
        assert r["errors"] == 0 and r["requests"] > 0
        assert r["server"]["requests"] == r["requests"]  # the server counted every answered request once
        assert round(r["server"]["inputs_per_batch"] * r["server"]["batches"]) == 2 * r["requests"]
        assert r["served_vs_raw"] == r["tokens_per_s"] / loop["summary"]["runner_raw_tokens_per_s"]

    single = {(r["client"], r["route"]): r for r in doc["scenarios"]["single"]["results"]}
    assert set(single) == {(c, route) for c in ("http.client", "httpx") for route in ("POST /infer", "GET /healthz")}
    assert single["http.client", "POST /infer"]["p50_ms"] > single["http.client", "GET /healthz"]["p50_ms"] > 0
    server = doc["scenarios"]["single"]["summary"]["server"]
    assert server["requests"] == 12 and server["inputs_per_batch"] == 1  # one at a time

    for label in ("replicas", "workers"):  # workers: one port, two processes, the metrics count both
        block = doc["scenarios"][label]
        assert [(r[label], r["payload"]) for r in block["results"]] == [(2, "text"), (2, "ids")]
        assert block["summary"]["mps"] is False and block["summary"]["sentence_transformers_tokens_per_s"] is None
        for point in block["results"]:
            assert point["errors"] == 0 and point["server"]["requests"] == point["requests"]
            assert point["server"]["cpu_ms_per_request"] > 0 and point["vs_sentence_transformers"] is None

    (soak,) = doc["scenarios"]["soak"]["results"]
    assert soak["wrong_answers"] == 0 and set(soak["statuses"]) == {"200"} and soak["answered"] >= 8
    assert (tmp_path / "serve-soak.log").is_file() and (tmp_path / "serve-replicas-2.log").is_file()

    cold, warm = doc["scenarios"]["startup"]["results"]
    assert (cold["start"], warm["start"]) == ("cold", "warm") and cold["ready_s"] > 0 and warm["ready_s"] > 0
    assert cold["first_requests"]["requests"] == 8 and "first_requests" not in warm
    slowest = cold["first_requests"]["slowest"]
    assert len(slowest) == 8 and [r["index"] for r in slowest] == list(range(8))  # fewer than 12: all, in order
    assert max(r["ms"] for r in slowest) == pytest.approx(cold["first_requests"]["max_ms"], abs=0.01)
    assert (tmp_path / "serve-startup-cold.log").is_file() and (tmp_path / "serve-startup-warm.log").is_file()

    alone, beside, large = doc["scenarios"]["head-of-line"]["results"]
    assert (alone["beside"], beside["beside"], large["beside"]) == ("nothing", "the largest requests", "one input")
    assert alone["requests"] > 0 and beside["requests"] > 0 and large["requests"] > 0
    assert alone["failed"] == beside["failed"] == {} and beside["p99_ms"] <= beside["max_ms"]
    summary = doc["scenarios"]["head-of-line"]["summary"]
    assert summary["large_inputs"] * summary["large_chars_each"] <= 512 * 1024  # within max_request_chars


def test_a_block_name_is_for_one_scenario(tmp_path):
    with pytest.raises(SystemExit, match="one scenario"):
        main(["serve", "startup", "single", "--device", "cpu", "--model", "tiny", "--as", "startup-other",
              "--out", str(tmp_path / "serve.json")])
    assert not (tmp_path / "serve.json").exists()
