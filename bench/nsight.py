"""Nsight Compute evidence for the fused row-wise ops: one launch of each op per provider (our Triton and CUDA
kernels, and torch.compile's), each warmed up (compiled, autotuned, launch-tuned) before the profiled region.

    ncu --profile-from-start off --clock-control none --cache-control all --csv --page raw --print-units base \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        python -m bench.nsight > ncu.csv
    python -m bench.nsight --table ncu.csv      # the markdown table docs/kernels.md shows

`bash bench/gpu.sh nsight` runs both on the GPU machine. Only the region between cudaProfilerStart and
cudaProfilerStop is profiled, one call per (op, provider) in the order printed on stderr.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys

import torch

from bench.kernels import DTYPES, EPS, providers, rowwise_inputs
from kernels.spec import ROWWISE_OPS

PROVIDERS = ("triton", "cuda", "compile")
# raw metric -> (column, scale): what the sections above collect
METRICS = {
    "gpu__time_duration.sum": ("duration us", 1e-3),  # ns with --print-units base
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": ("DRAM throughput %", 1),
    "smsp__issue_active.avg.per_cycle_active": ("issue slots busy %", 100),
    "sm__warps_active.avg.pct_of_peak_sustained_active": ("achieved occupancy %", 1),
    "sm__maximum_warps_per_active_cycle_pct": ("theoretical occupancy %", 1),
    "launch__registers_per_thread": ("registers", 1),
    "smsp__average_warp_latency_per_inst_issued.ratio": ("cycles per issued instruction", 1),
    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio": ("of which long scoreboard", 1),
}


def profiled_order(names: list[str]) -> list[str]:
    """The providers in the order `run` calls them (bench.kernels.providers builds them in this order)."""
    return [p for p in ("eager", "compile", "triton", "cuda") if p in names]


def run(ops: list[str], dtype: torch.dtype, rows: int, cols: int, names: list[str]) -> None:
    provs, missing = providers(names)
    calls = []
    for i, op in enumerate(ops):
        inputs = rowwise_inputs(op, rows, cols, dtype, "cuda", seed=i)
        for name, get in provs.items():
            fn = get(op)
            for _ in range(3):  # compile, autotune and launch-tune outside the profiled region
                fn(*inputs)
            calls.append((f"{op} {name}", fn, inputs))
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for label, fn, inputs in calls:
        print(f"profiled: {label}", file=sys.stderr, flush=True)
        fn(*inputs)
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def table(csv_text: str, labels: list[str]) -> str:
    """ncu's raw CSV (one row per kernel, in launch order) as a markdown table, the kernels named by `labels` (the
    profiled calls, in order; a call of several kernels gets one row per kernel)."""
    lines = [line for line in csv_text.splitlines() if line.startswith('"')]
    reader = csv.DictReader(io.StringIO("\n".join(lines)))
    kernels = [r for r in reader if r.get("ID", "").isdigit()]
    head = ["call", "kernel"] + [column for column, _ in METRICS.values()]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(kernels):
        label = labels[i] if len(labels) == len(kernels) else "-"
        name = r.get("Kernel Name", "?").split("(")[0][:40]
        values = []
        for metric, (_, scale) in METRICS.items():
            value = r.get(metric, "")
            try:
                number = float(value.replace(",", "")) * scale
                values.append(f"{number:.1f}" if number < 100 else f"{number:.0f}")
            except ValueError:
                values.append(value or "-")
        out.append("| " + " | ".join([label, f"`{name}`"] + values) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.nsight", description=__doc__.splitlines()[0])
    parser.add_argument("--ops", nargs="+", choices=list(ROWWISE_OPS), default=list(ROWWISE_OPS))
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    parser.add_argument("--shape", default="32768x768", help="ROWSxCOLS")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--table", metavar="CSV", help="print the markdown table of an ncu raw CSV of this run")
    args = parser.parse_args(argv)
    rows, cols = map(int, args.shape.split("x"))
    if args.table:
        with open(args.table) as f:
            text = f.read()
        labels = [f"{op} {p}" for op in args.ops for p in profiled_order(args.providers)]
        print(f"Nsight Compute, {args.dtype} {args.shape}, eps {EPS}:\n")
        print(table(text, labels))
        return 0
    run(args.ops, DTYPES[args.dtype], rows, cols, args.providers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
