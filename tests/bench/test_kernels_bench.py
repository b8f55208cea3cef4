"""The benchmark harness runs end to end (tiny shape, CPU): it must not rot between GPU runs.
It asserts the report's structure, never a time."""

from __future__ import annotations

import json

from bench import kernels as bench_kernels


def test_harness_writes_json_and_markdown(tmp_path):
    out, md = tmp_path / "r.json", tmp_path / "t.md"
    bench_kernels.main(["--device", "cpu", "--providers", "triton", "eager", "--ops", "bias_gelu", "add_layer_norm",
                        "--dtypes", "float32", "--shapes", "8x64", "--out", str(out), "--markdown", str(md)])
    report = json.loads(out.read_text())
    cells = {(r["op"], r["provider"]) for r in report["results"]}
    assert cells == {(op, p) for op in ("bias_gelu", "add_layer_norm") for p in ("triton", "eager")}
    assert all(r["accurate"] for r in report["results"])
    assert report["copy_gbps"] > 0
    assert bench_kernels.min_bytes("add_layer_norm", 8, 64, __import__("torch").float32) == 3 * 8 * 64 * 4
    assert "| bias_gelu | float32 | 8x64 |" in md.read_text()
