"""`python -m bench serve frontends`: the configurations, the ratios over the first one on made-up rows; then the
scenario end to end on the CPU (tiny preset): one full server against one front-end before one engine, every point
of each with both sides' CPU. It asserts structure and counts, never a rate."""

from __future__ import annotations

import argparse

import pytest

from bench import frontends_load
from bench import results as store
from bench.__main__ import main


def test_configurations_and_ratios():
    assert frontends_load.config("workers=auto") == ("workers", "auto")
    assert frontends_load.config("frontends=4") == ("frontends", "4")
    for bad in ("workers", "replicas=2", "frontends="):
        with pytest.raises(argparse.ArgumentTypeError):
            frontends_load.config(bad)
    rows = [{"config": c, "point": p, "requests_per_s": r} for c, p, r in (
        ("workers=auto", "64x1", 100.0), ("workers=auto", "64x16", 10.0),
        ("frontends=2", "64x1", 150.0), ("frontends=2", "64x16", 12.5), ("frontends=4", "64x1", 50.0))]
    assert frontends_load.ratios(rows) == {"frontends=2": {"64x1": 1.5, "64x16": 1.25}, "frontends=4": {"64x1": 0.5}}
    assert frontends_load.ratios([]) == {}


@pytest.mark.slow
def test_the_scenario_end_to_end(tmp_path):
    out = tmp_path / "serve.json"
    assert main(["serve", "frontends", "--device", "cpu", "--model", "tiny", "--setting", "torch_threads=1",
                 "--setting", "backend=torch", "--seconds", "1", "--warm-seconds", "0.3", "--texts", "64",
                 "--max-words", "20", "--frontends-configs", "workers=1", "frontends=1", "--frontends-points", "1x1",
                 "4x2", "--client-processes", "1", "--log-dir", str(tmp_path), "--out", str(out)]) == 0
    doc = store.load(out)
    assert store.validate(doc) == [] and list(doc["scenarios"]) == ["frontends"]
    block = doc["scenarios"]["frontends"]
    assert block["complete"] and block["settings"]["configs"] == ["workers=1", "frontends=1"]
    rows, summary = block["results"], block["summary"]
    assert [(r["config"], r["point"]) for r in rows] == [
        (c, p) for c in ("workers=1", "frontends=1") for p in ("1x1", "4x2")]
    for r in rows:
        assert r["requests"] > 0 and r["errors"] == 0, r
        assert r["server_cpu_ms_per_request"] > 0 and r["client_cpu_share"] > 0, r
    assert set(summary["ratios"]) == {"frontends=1"} and set(summary["ratios"]["frontends=1"]) == {"1x1", "4x2"}
    assert summary["tokenizer"]["tokens_per_s_per_core"] > 0
    # the front-end's server log names its engine: the scenario ran the process model it says
    assert "front-ends in front of an engine" in (tmp_path / "serve-frontends-frontends-1.log").read_text()
