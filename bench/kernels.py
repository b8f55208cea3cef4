"""Kernel benchmark: every fused op x dtype x shape, our backends side by side with the same unfused
computation in eager PyTorch and under torch.compile, in one run, against the device's measured copy
bandwidth. Median of many timed runs after warm-up (triton.testing.do_bench, L2 flushed between runs).

    python -m bench.kernels --out bench/results/$(date +%F)-h200-kernels.json --markdown docs/kernels-table.md

GB/s counts the fewest bytes the op must move: every input element read once, every output written once
(embedding_layer_norm: the gathered word rows, the id vectors and the output; the small position and
token-type tables are treated as cache-resident).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench import command, save
from kernels.testing import OP_SPECS, ROWWISE_OPS, compare, float64_reference
from model.runner import DTYPES

SHAPES = [(4096, 768), (32768, 384), (32768, 768), (16384, 1024), (8192, 4096)]
EPS = 1e-5


# The unfused PyTorch a user would write, in the input dtype: the eager and torch.compile providers.
def _unfused(op: str) -> Callable:
    return {
        "layer_norm": lambda x, w, b, eps: F.layer_norm(x, x.shape[-1:], w, b, eps),
        "layer_norm_gelu": lambda x, w, b, eps: F.gelu(F.layer_norm(x, x.shape[-1:], w, b, eps)),
        "bias_gelu": lambda x, bias: F.gelu(x + bias),
        "bias_residual_gelu": lambda x, bias, r: F.gelu(x + bias + r),
        "add_layer_norm": lambda x, r, bias, w, b, eps: F.layer_norm(x + bias + r, x.shape[-1:], w, b, eps),
        "embedding_layer_norm": lambda ids, pos, tt, word, position, ttype, w, b, eps: F.layer_norm(
            word[ids] + position[pos] + ttype[tt], word.shape[-1:], w, b, eps),
    }[op]


def _inputs(op: str, rows: int, cols: int, dtype: torch.dtype, device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    if op == "embedding_layer_norm":  # real-sized tables: BERT vocabulary, 512 positions, 2 types
        ids = torch.randint(0, 30522, (rows,), generator=gen).to(device)
        pos = torch.randint(0, 512, (rows,), generator=gen).to(device)
        tt = torch.randint(0, 2, (rows,), generator=gen).to(device)
        tables = [torch.randn(n, cols, generator=gen).to(device, dtype) for n in (30522, 512, 2)]
        w, b = (torch.randn(cols, generator=gen).to(device, dtype) for _ in range(2))
        return (ids, pos, tt, *tables, w, b, EPS)
    args, _ = OP_SPECS[op].make_inputs(rows, cols, dtype, device, gen)
    return args


def min_bytes(op: str, rows: int, cols: int, dtype: torch.dtype) -> int:
    e = torch.finfo(dtype).bits // 8
    matrices = {"layer_norm": 2, "layer_norm_gelu": 2, "bias_gelu": 2, "bias_residual_gelu": 3,
                "add_layer_norm": 3, "embedding_layer_norm": 2}[op]
    extra = 3 * 8 * rows if op == "embedding_layer_norm" else 0
    return matrices * rows * cols * e + extra


def graph_ms(fn: Callable[[], object], reps: int = 100) -> float:
    """Device time of one call: `fn` captured in a CUDA graph (no Python or launch overhead), replayed
    `reps` times with the L2 flushed before each replay; median of event timings."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush.zero_()
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def bench_ms(fn: Callable[[], object], device: str) -> float:
    """Time of one call as a caller sees it: launched from Python, back to back (do_bench, L2 flushed)."""
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))
    fn()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: str) -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    n = (1 << 30) if device == "cuda" else (1 << 24)
    src = torch.randn(n // 4, device=device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device)
    return 2 * src.numel() * 4 / ms / 1e6


def providers(names: list[str], device: str) -> dict[str, Callable[[str], Callable]]:
    available: dict[str, Callable[[str], Callable]] = {}
    if "eager" in names:
        available["eager"] = _unfused
    if "compile" in names:
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = 1024  # one compile per op x dtype x shape, no fallback
        compiled: dict[str, Callable] = {}

        def get_compiled(op: str) -> Callable:
            if op not in compiled:
                compiled[op] = torch.compile(_unfused(op), dynamic=False)
            return compiled[op]

        available["compile"] = get_compiled
    if "triton" in names:
        try:
            from kernels.triton import LAUNCHERS
        except ImportError as exc:
            print(f"provider triton: unavailable ({exc})", file=sys.stderr)
        else:
            available["triton"] = LAUNCHERS.__getitem__
    if "cuda" in names:
        from kernels import cuda

        try:
            available["cuda"] = cuda.load().__getitem__
        except cuda.BuildUnavailable as exc:
            print(f"provider cuda: unavailable ({exc})", file=sys.stderr)
    return available


def run(args: argparse.Namespace) -> dict:
    device = args.device
    ops = args.ops or list(ROWWISE_OPS)  # the memory-bound ops; the FFN-in GEMM has bench/linear_gelu.py
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes] if args.shapes else SHAPES
    dtypes = [DTYPES[d] for d in (args.dtypes or DTYPES)]
    copy_gbps = copy_bandwidth(device)
    print(f"device copy bandwidth: {copy_gbps:.0f} GB/s", file=sys.stderr)
    provs = providers(args.providers, device)
    results = []
    total = len(ops) * len(shapes) * len(dtypes)
    done = 0
    for op in ops:
        for dtype in dtypes:
            for rows, cols in shapes:
                done += 1
                inputs = _inputs(op, rows, cols, dtype, device, seed=done)
                nbytes = min_bytes(op, rows, cols, dtype)
                ref = float64_reference(op, inputs, {}) if args.check else None
                line = []
                for name, get in provs.items():
                    fn = get(op)
                    out = fn(*inputs)  # warm-up: compile / autotune outside the timing
                    if isinstance(out, tuple):
                        out = out[0]
                    err = compare(out, ref, dtype) if ref is not None else None
                    launch = bench_ms(lambda: fn(*inputs), device)
                    ms = graph_ms(lambda: fn(*inputs)) if device == "cuda" else launch
                    gbps = nbytes / ms / 1e6
                    results.append({
                        "op": op, "dtype": str(dtype).removeprefix("torch."), "rows": rows, "cols": cols,
                        "provider": name, "ms": ms, "launch_ms": launch, "gbps": gbps,
                        "pct_copy": 100 * gbps / copy_gbps,
                        "bytes": nbytes, "rel_l2": err.rel_l2 if err else None, "max_abs": err.max_abs if err else None,
                        "accurate": err.ok if err else None,
                    })
                    line.append(f"{name} {ms * 1e3:7.1f}us ({launch * 1e3:6.1f} launched) {gbps:5.0f}GB/s")
                print(f"[{done}/{total}] {op} {str(dtype).removeprefix('torch.')} {rows}x{cols}: " + " | ".join(line),
                      file=sys.stderr, flush=True)
                save(_report(copy_gbps, results), args.out)  # incremental: a run cut short keeps its numbers
    report = _report(copy_gbps, results)
    if device == "cuda" and {"triton", "cuda"} <= set(provs):
        report["auto_mode"] = auto_mode_choices(dtypes, sorted({c for _, c in shapes}))
    if "cuda" in provs:
        from kernels.cuda.tuning import TUNER

        report["cuda_tuning"] = TUNER.table()
    return report


def auto_mode_choices(dtypes: list[torch.dtype], widths: list[int]) -> dict:
    """What the registry's auto mode picks per op (its startup race) for each dtype and hidden width."""
    import kernels

    choices = {}
    for dtype in dtypes:
        for cols in widths:
            selection = kernels.configure("cuda", (dtype,), hidden_sizes=(cols,))
            key = f"{str(dtype).removeprefix('torch.')} {cols}"
            choices[key] = {op: {"backend": c["backend"], "timings_us": c.get("timings_us")}
                            for op, c in selection.as_dict()["ops"].items()}
            print(f"auto mode {key}: " + ", ".join(f"{op}={c['backend']}" for op, c in choices[key].items()),
                  file=sys.stderr)
    return choices


def _report(copy_gbps: float, results: list[dict]) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return {
        "date": dt.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": _version("triton"),
        "copy_gbps": copy_gbps,
        "command": command("kernels"),
        "results": results,
    }


def _version(pkg: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(pkg)
    except Exception:
        return None


def markdown(report: dict, fused: str = "triton") -> str:
    """One row per op x dtype x shape: the fused provider's time, GB/s and % of copy, eager and compile
    side by side, and the speed-up over torch.compile."""
    by_cell: dict[tuple, dict[str, dict]] = {}
    for r in report["results"]:
        by_cell.setdefault((r["op"], r["dtype"], r["rows"], r["cols"]), {})[r["provider"]] = r
    fused_providers = [p for p in ("triton", "cuda") if any(p in c for c in by_cell.values())]
    head = ["op", "dtype", "shape", "MB"]
    for p in fused_providers:
        head += [f"{p} us", f"{p} GB/s", f"{p} % copy"]
    head += ["eager us", "eager GB/s", "compile us", "compile GB/s"] + [f"{p} vs compile" for p in fused_providers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (op, dtype, rows, cols), cell in by_cell.items():
        any_row = next(iter(cell.values()))
        row = [op, dtype, f"{rows}x{cols}", f"{any_row['bytes'] / 1e6:.0f}"]
        for p in fused_providers:
            r = cell.get(p)
            row += [f"{r['ms'] * 1e3:.1f}", f"{r['gbps']:.0f}", f"{r['pct_copy']:.0f}%"] if r else ["-"] * 3
        for p in ("eager", "compile"):
            r = cell.get(p)
            row += [f"{r['ms'] * 1e3:.1f}", f"{r['gbps']:.0f}"] if r else ["-", "-"]
        for p in fused_providers:
            r, c = cell.get(p), cell.get("compile")
            row.append(f"{c['ms'] / r['ms']:.2f}x" if r and c else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--providers", nargs="+", default=["triton", "cuda", "eager", "compile"])
    parser.add_argument("--ops", nargs="+", choices=list(ROWWISE_OPS))
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES))
    parser.add_argument("--shapes", nargs="+", help="ROWSxCOLS, e.g. 4096x768")
    parser.add_argument("--no-check", dest="check", action="store_false", help="skip the float64 accuracy check")
    parser.add_argument("--out", help="write the JSON report here")
    parser.add_argument("--markdown", help="write the markdown table here")
    parser.add_argument("--render", metavar="JSON", help="only re-render the table of an earlier run's JSON")
    args = parser.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            report = json.load(f)
    else:
        report = run(args)
    if not args.render:
        save(report, args.out)
    table = markdown(report)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
