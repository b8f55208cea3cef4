"""bench.nsight's side that runs without a GPU: ncu's raw CSV into results rows of the kernels file, each kernel
named by the call that launched it, and the report's table of them."""

from __future__ import annotations

import csv
import io
import json

import pytest

from bench import nsight, report
from bench import results as store


def _ncu_csv(kernels: list[tuple[str, dict[str, str]]]) -> str:
    """What `ncu --csv --page raw --print-units base` prints: its own log lines, a header, a units row, a row per
    kernel."""
    columns = ["ID", "Kernel Name", *nsight.METRICS]
    out = io.StringIO()
    writer = csv.writer(out, quoting=csv.QUOTE_ALL)
    writer.writerow(columns)
    writer.writerow(["", "", *["" for _ in nsight.METRICS]])
    for i, (name, values) in enumerate(kernels):
        writer.writerow([str(i), name, *[values.get(m, "") for m in nsight.METRICS]])
    return "==PROF== Connected to process 1\n" + out.getvalue() + "==PROF== Disconnected from process 1\n"


def test_a_raw_csv_becomes_one_row_per_call_in_launch_order(tmp_path):
    values = {"gpu__time_duration.sum": "25,280", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": "63.73",
              "smsp__issue_active.avg.per_cycle_active": "0.44", "launch__registers_per_thread": "58"}
    text = _ncu_csv([("triton_per_fused_native_layer_norm_0", values), ("_norm_kernel(...)", {}),
                     ("void fusedserve::<unnamed>::norm_kernel<float, 4>(fusedserve::NormArgs)", {})])
    calls = [("layer_norm", "compile"), ("layer_norm", "triton"), ("layer_norm", "cuda")]  # as the run wrote them
    rows = nsight.parse(text, calls, "bfloat16", "32768x768", {"layer_norm": "BLOCK_M 2, 1 warps"})
    assert [(r["provider"], r["kernel"]) for r in rows] == [
        ("compile", "triton_per_fused_native_layer_norm_0"), ("triton", "_norm_kernel"),
        ("cuda", "norm_kernel<float, 4>")]
    first = rows[0]
    assert first["us"] == pytest.approx(25.28) and first["dram_pct"] == pytest.approx(63.73)
    assert first["issue_busy_pct"] == pytest.approx(44.0) and first["registers"] == 58
    assert first["occupancy_pct"] is None and "config" not in first  # a metric ncu did not print; not Triton
    assert rows[1]["config"] == "BLOCK_M 2, 1 warps"

    # stored as scenario `nsight` of the kernels file, which validates, and rendered by the report
    path = tmp_path / "kernels.json"
    (tmp_path / "ncu.csv").write_text(text)
    (tmp_path / "calls.json").write_text(json.dumps({"calls": [list(c) for c in calls],
                                                     "configs": {"layer_norm": "BLOCK_M 2, 1 warps"}}))
    assert nsight.main(["--ops", "layer_norm", "--save", str(tmp_path / "ncu.csv"), "--calls",
                        str(tmp_path / "calls.json"), "--device", "cpu", "--out", str(path)]) == 0
    doc = store.load(path)
    assert store.validate(doc) == [] and doc["scenarios"]["nsight"]["header"]["command"].startswith(
        "python -m bench.nsight --ops layer_norm")
    table = report.tables(path)
    compile_row = "| layer_norm | compile | `triton_per_fused_native_layer_norm_0` | 25.3 | 64% | 44% | - of - | 58 |"
    assert compile_row in table and "| layer_norm | cuda | `norm_kernel<float, 4>` |" in table
    assert "`_norm_kernel` (BLOCK_M 2, 1 warps)" in table


def test_ncu_args_come_from_one_place(capsys):
    assert nsight.main(["--ncu-args"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == nsight.NCU_ARGS.split() and "application-only" in printed and "raw" in printed


def test_kernels_that_cannot_be_named_are_refused():
    text = _ncu_csv([("a", {})])
    with pytest.raises(SystemExit, match="1 kernels profiled for 2 calls"):
        nsight.parse(text, [("layer_norm", "triton"), ("layer_norm", "cuda")], "bfloat16", "8x8")
