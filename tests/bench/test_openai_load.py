"""`python -m bench serve openai-load`: the points, the order of the starts, the medians and the before/after verdict
on made-up rows; then the scenario end to end on the CPU (tiny preset) against this tree's server and a baseline
tree, made up here, whose `python -m server` records each start and then runs this tree's server. It asserts
structure and counts, never a rate."""

from __future__ import annotations

import argparse
import statistics
import textwrap

import pytest

from bench import harness, openai_load
from bench import results as store
from bench.__main__ import main
from fusedserve.model.tokenizer import TextTokenizer
from fusedserve.model.weights import default_model_dir


def test_points_and_the_order_of_starts():
    assert openai_load.point("64x16") == (64, 16) and openai_load.point("1X1") == (1, 1)
    for bad in ("64", "0x1", "ax2", "1x2x3"):
        with pytest.raises(argparse.ArgumentTypeError):
            openai_load.point(bad)
    # every round starts each tree once, the order reversed every round
    assert openai_load.start_order(["baseline", "current"], 3) == [
        (0, "baseline"), (0, "current"), (1, "current"), (1, "baseline"), (2, "baseline"), (2, "current")]
    assert openai_load.start_order(["current"], 2) == [(0, "current"), (1, "current")]


def _row(tree: str, start: int, clients: int, per_request: int, requests_per_s: float, p50_ms: float,
         errors: int = 0) -> dict:
    return {"tree": tree, "start": start, "point": f"{clients}x{per_request}", "clients": clients,
            "per_request": per_request, "errors": errors, "requests_per_s": requests_per_s,
            "texts_per_s": requests_per_s * per_request, "tokens_per_s": requests_per_s * per_request * 50,
            "p50_ms": p50_ms, "p99_ms": 2 * p50_ms, "client_cpu_share": 0.25, "server_cpu_cores": 1.0}


def test_medians_and_the_verdict():
    rows = [_row("baseline", s, 64, 16, rate, 40.0) for s, rate in enumerate((100.0, 90.0, 130.0))] + \
        [_row("current", s, 64, 16, rate, 41.0) for s, rate in enumerate((98.0, 300.0, 50.0))] + \
        [_row("baseline", s, 1, 1, 500.0, p50) for s, p50 in enumerate((2.0, 1.9, 5.0))] + \
        [_row("current", s, 1, 1, 490.0, p50) for s, p50 in enumerate((2.1, 1.8, 2.0))]
    per_tree = openai_load.medians(rows)
    # the middle of three, per metric: 100 and 98 requests/s; 2.0 and 2.0 ms
    assert per_tree["baseline"]["64x16"]["requests_per_s"] == 100.0 and per_tree["current"]["64x16"]["starts"] == 3
    assert per_tree["current"]["64x16"]["tokens_per_s"] == 98.0 * 16 * 50
    assert per_tree["baseline"]["1x1"]["p50_ms"] == 2.0 == per_tree["current"]["1x1"]["p50_ms"]
    verdict = openai_load.comparison(per_tree, max_throughput_loss=0.03, max_p50_increase_ms=0.1)
    several, one = verdict["points"]["64x16"], verdict["points"]["1x1"]
    assert several["requests_per_s_ratio"] == pytest.approx(0.98) and several["within_bounds"]  # 2% lost, 3% allowed
    assert one["p50_ms_change"] == 0.0 and one["within_bounds"]  # one client: only the p50 counts, not 2% fewer
    assert verdict["no_regression"]
    assert not openai_load.comparison(per_tree, 0.01, 0.1)["points"]["64x16"]["within_bounds"]
    slower = openai_load.medians([r if r["point"] != "1x1" or r["tree"] != "current" else {**r, "p50_ms": 2.2}
                                  for r in rows])
    late = openai_load.comparison(slower, 0.03, 0.1)
    assert late["points"]["1x1"]["p50_ms_change"] == pytest.approx(0.2) and not late["no_regression"]
    failing = openai_load.medians([{**r, "errors": 1} if r["tree"] == "current" and r["start"] == 0 else r
                                   for r in rows])
    assert not openai_load.comparison(failing, 0.03, 0.1)["no_regression"]  # an error anywhere: not within bounds


# An older tree's `python -m fusedserve serve`, as the scenario starts it: from its root, its folder first on the path.
# It records that, then this tree's server stands in for the older one's (the fake package out of the way first).
FAKE_BASELINE_MAIN = '''\
import os
import sys
from pathlib import Path

root = Path(__file__).resolve().parents[1]
with open(root / "starts.txt", "a") as record:
    record.write(f"{os.getcwd()}|{sys.path[0]}\\n")
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != root]
for name in [m for m in sys.modules if m == "fusedserve" or m.startswith("fusedserve.")]:
    del sys.modules[name]

from fusedserve.cli import main

sys.exit(main(sys.argv[1:]))
'''


def test_openai_load_against_real_servers(tmp_path):
    baseline = tmp_path / "baseline"
    (baseline / "fusedserve" / "server").mkdir(parents=True)
    (baseline / "fusedserve" / "__init__.py").write_text("")
    (baseline / "fusedserve" / "server" / "__main__.py").write_text("")  # where a baseline's server is looked for
    (baseline / "fusedserve" / "__main__.py").write_text(textwrap.dedent(FAKE_BASELINE_MAIN))
    (baseline / "source.json").write_text('{"git_sha": "0123abc", "git_dirty": false}\n')
    out = tmp_path / "serve.json"
    texts, max_words = 24, 12
    assert main(["serve", "openai-load", "--device", "cpu", "--model", "tiny", "--setting", "torch_threads=1",
                 "--setting", "verify_sample_rate=1",
                 "--setting", "backend=torch", "--seconds", "1", "--warm-seconds", "0.3", "--texts", str(texts),
                 "--max-words", str(max_words), "--openai-points", "1x1", "3x2", "--grpc-points", "2x2",
                 "--client-processes", "2",
                 "--baseline", str(baseline), "--starts", "2", "--log-dir", str(tmp_path), "--out", str(out)]) == 0
    doc = store.load(out)
    assert store.validate(doc) == [] and list(doc["scenarios"]) == ["openai-load"]
    block = doc["scenarios"]["openai-load"]
    assert block["complete"] and block["settings"]["points"] == ["1x1", "3x2"]
    assert "per_request" not in block["settings"]  # the points say it
    rows, summary = block["results"], block["summary"]
    # gRPC on this tree's server only (the older tree may have none), after its HTTP points
    assert [(r["tree"], r["start"], r["point"]) for r in rows] == [
        (tree, start, point) for start, tree in ((0, "baseline"), (0, "current"), (1, "current"), (1, "baseline"))
        for point in ("1x1", "3x2", *(("grpc-2x2",) if tree == "current" else ()))]
    # the baseline's rows came from its own starts: two, each from its root with its folder first on the path
    starts = (baseline / "starts.txt").read_text().splitlines()
    assert starts == [f"{baseline.resolve()}|{baseline.resolve()}"] * 2
    assert summary["trees"]["baseline"]["source"]["git_sha"] == "0123abc"
    assert summary["trees"]["baseline"]["command"] == "-m fusedserve serve"
    assert summary["same_model_min_cosine"] > harness.SAME_MODEL_MIN_COSINE  # it serves this tree's model

    corpus = harness.mixed_texts(texts, low=5, high=max_words)
    counts = [len(row) for row in TextTokenizer(default_model_dir(), 128).encode(corpus)]
    for r in rows:
        assert r["errors"] == 0 and r["requests"] > 0 and r["p50_ms"] <= r["p99_ms"]
        answered = r["requests"] * r["per_request"]
        assert r["texts_per_s"] * r["seconds"] == pytest.approx(answered)
        # the CPU both sides took: the load generator's processes, and the server's own account (/metrics)
        assert 0 < r["client_cpu_share"] <= 1 and r["client_cpu_cores"] > 0
        assert r["server_cpu_cores"] > 0 and r["server_cpu_ms_per_request"] > 0
        # VERIFY_SAMPLE_RATE=1: every batch of the point went to the verifier (the reference against its fp32 copy)
        assert r["reference_checks"]["match"] > 0 and r["reference_checks"]["mismatch"] == 0, r["reference_checks"]
        if r["point"].startswith("grpc-"):  # no usage in a gRPC answer
            assert r["tokens_per_s"] == 0
            continue
        # tokens: each answer's usage, so between the corpus's shortest and longest text for every text answered
        assert min(counts) * answered <= round(r["tokens_per_s"] * r["seconds"]) <= max(counts) * answered
    for tree in ("baseline", "current"):
        for point in ("1x1", "3x2"):
            mine = [r for r in rows if r["tree"] == tree and r["point"] == point]
            m = summary["medians"][tree][point]
            assert m["starts"] == 2 and m["p50_ms"] == pytest.approx(statistics.median(r["p50_ms"] for r in mine))
    for point, c in summary["comparison"]["points"].items():
        before, after = summary["medians"]["baseline"][point], summary["medians"]["current"][point]
        assert c["tokens_per_s_ratio"] == pytest.approx(after["tokens_per_s"] / before["tokens_per_s"])
        assert c["p50_ms_change"] == pytest.approx(after["p50_ms"] - before["p50_ms"])
    assert summary["comparison"]["no_regression"] == all(c["within_bounds"]
                                                         for c in summary["comparison"]["points"].values())
    assert (tmp_path / "serve-openai-load-baseline-2.log").is_file()
    assert (tmp_path / "serve-openai-load-current-2.log").is_file()
