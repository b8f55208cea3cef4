"""bench.nsight's side that runs without a GPU: ncu's raw CSV into results rows of the kernels file, each kernel
named by the call that launched it, and the report's table of them."""

from __future__ import annotations

import csv
import io
import json

import pytest
import torch

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


def test_the_fp8_profile_is_stored_with_each_kernel_at_its_own_width(tmp_path):
    """--fp8: each quantizing kernel after the fp16 kernel of its op, bias_gelu's pair at the FFN width; stored as
    scenario nsight-fp8 beside nsight, and rendered as its table with the widths that differ from --shape."""
    calls = [("add_layer_norm", "triton"), ("add_layer_norm_quantize", "triton fp8"), ("bias_gelu", "triton"),
             ("bias_gelu_quantize", "triton fp8"), ("quantize_rows", "triton fp8")]
    assert [op for op, _ in calls if op.endswith("quantize") or op == "quantize_rows"] == \
        [op for op, _, _ in nsight.FP8_KERNELS]
    times = ("14,100", "15,900", "40,200", "56,400", "9,800")
    text = _ncu_csv([(name, {"gpu__time_duration.sum": t}) for name, t in
                     zip(("_norm_kernel", "_add_layer_norm_quantize_kernel", "_bias_gelu_kernel",
                          "_bias_gelu_quantize_kernel", "_quantize_kernel"), times)])
    shapes = {"add_layer_norm": "8990x768", "add_layer_norm_quantize": "8990x768", "bias_gelu": "8990x3072",
              "bias_gelu_quantize": "8990x3072", "quantize_rows": "8990x768"}
    (tmp_path / "ncu.csv").write_text(text)
    (tmp_path / "calls.json").write_text(json.dumps({
        "calls": [list(c) for c in calls], "shapes": shapes,
        "configs": {"add_layer_norm_quantize": "ROWS 4, 4 warps", "bias_gelu": "BLOCK_M 1, 8 warps"}}))
    path = tmp_path / "kernels.json"
    args = ["--save", str(tmp_path / "ncu.csv"), "--calls", str(tmp_path / "calls.json"), "--device", "cpu",
            "--out", str(path)]
    assert nsight.main(args + ["--fp8"]) == 0
    doc = store.load(path)
    block = doc["scenarios"]["nsight-fp8"]
    assert store.validate(doc) == [] and block["header"]["command"] == "python -m bench.nsight --fp8 --shape 8990x768"
    assert block["settings"]["dtype"] == "float16"
    assert [(r["op"], r["shape"], r["us"]) for r in block["results"]][2:4] == [
        ("bias_gelu", "8990x3072", pytest.approx(40.2)), ("bias_gelu_quantize", "8990x3072", pytest.approx(56.4))]
    table = report.tables(path)
    assert "scenario `nsight-fp8`" in table
    assert "| bias_gelu_quantize (8990x3072) | triton fp8 | `_bias_gelu_quantize_kernel` | 56.4 |" in table
    assert "| add_layer_norm_quantize | triton fp8 | `_add_layer_norm_quantize_kernel` (ROWS 4, 4 warps) | 15.9 |" in table


def test_fp8_takes_float16_only():
    with pytest.raises(SystemExit):
        nsight.main(["--fp8", "--dtype", "bfloat16"])


def test_the_fp8_calls_run_each_kernel_after_its_fp16_counterpart(device):
    """What the profiled --fp8 run launches (on the interpreter here): five calls in FP8_KERNELS' order, each fp16
    kernel on the very inputs of the quantizing kernel after it, and the configs both kinds ran."""
    calls, configs, shapes = nsight.fp8_calls(7, 64, device=device)
    assert [(op, provider) for op, provider, _, _ in calls] == [
        ("add_layer_norm", "triton"), ("add_layer_norm_quantize", "triton fp8"), ("bias_gelu", "triton"),
        ("bias_gelu_quantize", "triton fp8"), ("quantize_rows", "triton fp8")]
    assert calls[0][3] is calls[1][3] and calls[2][3] is calls[3][3] and len(calls[4][3]) == 1
    assert shapes["bias_gelu_quantize"] == "7x256" and shapes["quantize_rows"] == "7x64"
    assert set(configs) == {op for op, _, _ in nsight.FP8_KERNELS}
    assert configs["add_layer_norm_quantize"].startswith("ROWS ")
    calls[2][2](*calls[2][3])  # the fp16 kernels' configs are the autotuner's, once run (run() reads them then)
    assert nsight._triton_config("bias_gelu").startswith("BLOCK_M ")
    q, scale = calls[4][2](*calls[4][3])
    assert q.dtype == torch.float8_e4m3fn and q.shape == (7, 64) and torch.isfinite(scale).all()
