"""bench/plot.py renders each kind of benchmark report to a PNG (the committed kernel JSON, and minimal reports
shaped like bench.encoder's and bench.serve's output)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from bench import plot  # noqa: E402

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def _png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_kernel_plot_from_the_committed_h200_run(tmp_path):
    report = json.loads((RESULTS / "2026-11-30-h200-kernels-cuda.json").read_text())
    plot.kernels(report, str(tmp_path / "k.png"))
    assert _png(tmp_path / "k.png")


def test_encoder_and_serve_plots(tmp_path):
    encoder = {"results": [
        {"case": c, "provider": p, "ms": ms, "gemm_floor_ms": 0.1}
        for c in ("a b1", "b b32") for p, ms in (("hf sdpa", 2.0), ("ours cuda packed graphs", 0.5))
    ] + [{"case": "a b1", "provider": "hf torch.compile", "error": "skipped"}]}
    plot.encoder(encoder, str(tmp_path / "e.png"))
    serve = {"runner_raw_tokens_per_s": 4e6, "sentence_transformers_fp16_tokens_per_s": 3e5,
             "runs": [{"clients": c, "tokens_per_s": 1e6 * c / 64, "p50_ms": c / 4, "p99_ms": c / 2}
                      for c in (16, 64, 256)]}
    plot.serve(serve, str(tmp_path / "s.png"))
    assert _png(tmp_path / "e.png") and _png(tmp_path / "s.png")
    assert plot.main(["nonsense", "a", "b"]) == 2


def test_replica_plot_from_the_committed_h200_serving_runs(tmp_path):
    target = tmp_path / "r.png"
    assert plot.main(["replicas", str(target), f"MPS={RESULTS / '2026-11-30-h200-serve-mps-s9.json'}",
                      f"one server={RESULTS / '2026-11-30-h200-serve-s8.json'}"]) == 0
    assert _png(target)
    assert plot.main(["replicas", str(target)]) == 2  # no report given
