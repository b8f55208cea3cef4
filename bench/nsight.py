"""Nsight Compute evidence for the fused row-wise ops: one launch of each op per provider (our Triton and CUDA
kernels, and torch.compile's), each warmed up (compiled, autotuned, launch-tuned) before the profiled region.

    ncu $(python -m bench.nsight --ncu-args) python -m bench.nsight --calls calls.json > ncu.csv
    python -m bench.nsight --save ncu.csv --calls calls.json  # -> scenario nsight of bench/results/<gpu>/kernels.json

`bash bench/gpu.sh nsight` runs both on the GPU machine; `python -m bench report` renders the scenario as the table
docs/kernels.md shows. With `--fp8` (scenario `nsight-fp8`, fp16 at BERT-base b128's 8990 tokens by default) the
calls are PRECISION=fp8's quantizing kernels, each after the fp16 Triton kernel of the same row-wise op: the before
and after of the FP8 path's norm and GELU epilogues. Only the region between cudaProfilerStart and cudaProfilerStop
is profiled: one call per (op, provider) that could run, in the order the profiled run writes to `--calls` (with the
Triton configs it ran).
Each row is one launch: a single sample, at the clocks the GPU ran (ncu does not lock them here), with the caches
flushed before it. ncu follows the benchmark process only: torch.compile's worker processes crashed under it.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import sys
from pathlib import Path

import torch

from bench import results as store
from bench.kernels import DTYPES, providers, rowwise_inputs
from fusedserve.kernels.spec import ROWWISE_OPS

NCU_ARGS = ("--target-processes application-only --profile-from-start off --clock-control none --cache-control all "
            "--csv --page raw --print-units base "
            "--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats")
PROVIDERS = ("triton", "cuda", "compile")
# raw metric -> (result field, scale): what the sections above collect
METRICS = {
    "gpu__time_duration.sum": ("us", 1e-3),  # ns with --print-units base
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": ("dram_pct", 1),
    "smsp__issue_active.avg.per_cycle_active": ("issue_busy_pct", 100),
    "sm__warps_active.avg.pct_of_peak_sustained_active": ("occupancy_pct", 1),
    "sm__maximum_warps_per_active_cycle_pct": ("theoretical_occupancy_pct", 1),
    "launch__registers_per_thread": ("registers", 1),
    "smsp__average_warp_latency_per_inst_issued.ratio": ("cycles_per_issue", 1),
    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio": ("long_scoreboard_cycles", 1),
}


def _triton_config(op: str) -> str | None:
    """The config the Triton autotuner ran last for `op`'s kernel: "BLOCK_M 2, 1 warps"."""
    from fusedserve.kernels.triton import _norm, _pointwise

    tuner = _pointwise._bias_gelu_kernel if op in ("bias_gelu", "bias_residual_gelu") else _norm._norm_kernel
    config = getattr(tuner, "best_config", None)
    return None if config is None else f"BLOCK_M {config.kwargs.get('BLOCK_M')}, {config.num_warps} warps"


# PRECISION=fp8's quantizing kernels (kernels/triton/fp8.py), each after its fp16 counterpart: (op, the fp16
# row-wise op whose inputs it takes, its width over the hidden width). quantize_rows (the attention output's copy
# for the FP8 output projection) has no fp16 counterpart.
FP8_KERNELS = (("add_layer_norm_quantize", "add_layer_norm", 1), ("bias_gelu_quantize", "bias_gelu", 4),
               ("quantize_rows", None, 1))
FP8_PROVIDER = "triton fp8"


def fp8_calls(rows: int, hidden: int, device: str = "cuda") -> tuple[list[tuple], dict[str, str], dict[str, str]]:
    """The --fp8 calls (op, provider, fn, inputs) in fp16, with the quantizing kernels' launch configs and each op's
    shape."""
    from fusedserve.kernels.triton import LAUNCHERS
    from fusedserve.kernels.triton import fp8

    calls, configs, shapes = [], {}, {}
    for i, (op, before, widen) in enumerate(FP8_KERNELS):
        cols = hidden * widen
        inputs = rowwise_inputs(before or "layer_norm", rows, cols, torch.float16, device, seed=i)
        if before is None:
            inputs = inputs[:1]
        else:
            calls.append((before, "triton", LAUNCHERS[before], inputs))
            shapes[before] = f"{rows}x{cols}"
        calls.append((op, FP8_PROVIDER, getattr(fp8, op), inputs))
        shapes[op] = f"{rows}x{cols}"
        _, n_rows, warps = fp8.launch_config(cols)
        configs[op] = f"ROWS {n_rows}, {warps} warps"
    return calls, configs, shapes


def run(ops: list[str], dtype: torch.dtype, rows: int, cols: int, names: list[str], calls_file: Path | None,
        fp8: bool = False) -> None:
    if fp8:
        calls, configs, shapes = fp8_calls(rows, cols)
    else:
        calls, configs, shapes = [], {}, {}
        provs, _ = providers(names)  # the unavailable ones are reported there and not called
        for i, op in enumerate(ops):
            inputs = rowwise_inputs(op, rows, cols, dtype, "cuda", seed=i)
            calls += [(op, name, get(op), inputs) for name, get in provs.items()]
    for op, name, fn, inputs in calls:
        for _ in range(3):  # compile, autotune and launch-tune outside the profiled region
            fn(*inputs)
        if name == "triton":
            configs[op] = _triton_config(op)
    if calls_file is not None:
        calls_file.write_text(json.dumps({"calls": [[op, name] for op, name, _, _ in calls], "configs": configs,
                                          "shapes": shapes}))
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for op, name, fn, inputs in calls:
        print(f"profiled: {op} {name}", file=sys.stderr, flush=True)
        fn(*inputs)
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def kernel_name(name: str) -> str:
    """ncu's demangled name without its parameter list, return type and namespaces:
    'void fusedserve::<unnamed>::norm_kernel<float, 4>(NormArgs)' -> 'norm_kernel<float, 4>'."""
    name = re.sub(r"^void ", "", name.split("(")[0])
    return re.sub(r"^(?:[A-Za-z_]\w*::|<unnamed>::)+", "", name)


def parse(csv_text: str, calls: list[tuple[str, str]], dtype: str, shape: str,
          configs: dict[str, str] | None = None, shapes: dict[str, str] | None = None) -> list[dict]:
    """ncu's raw CSV (a header row, a units row, then one row per kernel in launch order) as result rows, each
    kernel named by its call (op, provider) when every call launched exactly one kernel; `shapes`: an op's own
    shape where it is not `shape`."""
    lines = [line for line in csv_text.splitlines() if line.startswith('"')]
    kernels = [r for r in csv.DictReader(io.StringIO("\n".join(lines))) if r.get("ID", "").isdigit()]
    if len(kernels) != len(calls):
        raise SystemExit(f"{len(kernels)} kernels profiled for {len(calls)} calls: cannot name them")
    rows = []
    for (op, provider), r in zip(calls, kernels):
        row = {"op": op, "dtype": dtype, "shape": (shapes or {}).get(op, shape), "provider": provider,
               "kernel": kernel_name(r.get("Kernel Name", "?"))}
        if provider.startswith("triton") and configs and configs.get(op):
            row["config"] = configs[op]
        for metric, (field, scale) in METRICS.items():
            try:
                row[field] = float(r[metric].replace(",", "")) * scale
            except (KeyError, ValueError):
                row[field] = None
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.nsight", description=__doc__.splitlines()[0])
    parser.add_argument("--ops", nargs="+", choices=list(ROWWISE_OPS), default=list(ROWWISE_OPS))
    parser.add_argument("--dtype", choices=list(DTYPES), default=None, help="default bfloat16 (float16 with --fp8)")
    parser.add_argument("--shape", default=None, help="ROWSxCOLS (default 32768x768; 8990x768 with --fp8)")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--calls", type=Path, help="the profiled run writes the calls it profiled, in order, and the "
                                                   "Triton configs they ran; --save reads them")
    parser.add_argument("--save", metavar="CSV", help="store the ncu raw CSV of a profiled run as scenario `nsight` "
                                                      "of the kernels results file")
    parser.add_argument("--device", default="cuda", help="with --save: the device the header describes")
    parser.add_argument("--out", help="with --save: the results file (default: bench/results/<gpu>/kernels.json)")
    parser.add_argument("--fp8", action="store_true", help="PRECISION=fp8's quantizing kernels in fp16, each after "
                                                           "the fp16 kernel of its op (--shape: tokens x hidden, "
                                                           "default 8990x768), stored as scenario nsight-fp8")
    parser.add_argument("--ncu-args", action="store_true", help="print the ncu arguments this profile takes")
    args = parser.parse_args(argv)
    if args.fp8 and args.dtype not in (None, "float16"):
        parser.error("--fp8 runs its kernels in float16")
    args.dtype = args.dtype or ("float16" if args.fp8 else "bfloat16")
    args.shape = args.shape or ("8990x768" if args.fp8 else "32768x768")
    if args.ncu_args:
        print(NCU_ARGS)
        return 0
    if args.save:
        if args.calls is None:
            parser.error("--save needs the --calls file the profiled run wrote")
        profiled = json.loads(args.calls.read_text())
        calls = [(op, provider) for op, provider in profiled["calls"]]
        results = parse(Path(args.save).read_text(), calls, args.dtype, args.shape, profiled.get("configs"),
                        profiled.get("shapes"))
        head = store.header(args.device, [])
        if args.fp8:
            head["command"] = f"python -m bench.nsight --fp8 --shape {args.shape}"
            settings = {"ops": [op for op, _, _ in FP8_KERNELS], "dtype": args.dtype, "shape": args.shape,
                        "providers": ["triton", FP8_PROVIDER], "profiler": f"ncu {NCU_ARGS}"}
        else:
            head["command"] = "python -m bench.nsight " + " ".join(
                f"--{k} {' '.join(v) if isinstance(v, list) else v}" for k, v in
                (("ops", args.ops), ("dtype", args.dtype), ("shape", args.shape), ("providers", args.providers)))
            settings = {"ops": args.ops, "dtype": args.dtype, "shape": args.shape, "providers": args.providers,
                        "profiler": f"ncu {NCU_ARGS}"}
        gpu = store.gpu_slug(head["gpu"])
        out = args.out or store.default_path("kernels", args.device)
        scenario = "nsight-fp8" if args.fp8 else "nsight"
        store.write(out, "kernels", gpu, scenario, store.block(head, settings, results))
        print(f"nsight: {len(results)} kernels -> {out}", file=sys.stderr)
        return 0
    rows, cols = map(int, args.shape.split("x"))
    run(args.ops, DTYPES[args.dtype], rows, cols, args.providers, args.calls, fp8=args.fp8)
    return 0


if __name__ == "__main__":
    sys.exit(main())
