"""Render the committed results: markdown tables (stdout) for docs/performance.md and PNG plots for docs/img/.

    python -m bench report                      # every results file's tables, and the plots of bench/results/h200
    python -m bench report --no-plots bench/results/h200/encoder.json
    python -m bench report --no-plots --compare BEFORE.json AFTER.json   # two encoder runs, row by row

Each table names the file and scenario its numbers come from; a number in a row is that row's field in
`scenarios.<scenario>.results` (or `.summary`) of that file.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from bench import results as store

SCENARIOS = ()
PLOTS = ("kernels", "encoder", "serve", "replicas", "workers")


def _f(value, digits: int = 1, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}{suffix}"


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def _source(path: Path, scenario: str, block: dict) -> str:
    h = block["header"]
    clocks = h.get("clocks") or {}
    host = h.get("host") or {}
    gpu = f"{h['gpu']}, driver {h['driver']}" if h.get("gpu") else \
        f"no GPU: {host.get('cpu') or 'CPU'}, {host.get('cores')} cores"
    clock = f", SM {clocks['sm_mhz']:.0f} / max {clocks['max_sm_mhz']:.0f} MHz at start" \
        if clocks.get("sm_mhz") and clocks.get("max_sm_mhz") else ""
    if h.get("converted"):
        sha = f"results committed in {h['git_sha'][:10]}, converted from the earlier format"
    elif h.get("git_sha"):
        sha = f"commit {h['git_sha'][:10]}{' + uncommitted changes' if h.get('git_dirty') else ''}"
    else:
        sha = "commit unknown"
    partial = " **(cut short: incomplete)**" if not block.get("complete", True) else ""
    return (f"`{path.as_posix()}`, scenario `{scenario}`{partial}: {h['date']}, {gpu}{clock}; torch {h['torch'] or '-'}, "
            f"triton {h.get('triton') or '-'}, CUDA {h.get('cuda') or '-'}; {sha}\n"
            f"`{h['command']}`\n")


# ---- kernels ----------------------------------------------------------------------------------------------------
def _fused_cells(block: dict) -> dict[tuple, dict[str, dict]]:
    cells: dict[tuple, dict[str, dict]] = {}
    for r in block["results"]:
        if "us" in r:
            cells.setdefault((r["op"], r["dtype"], r["shape"]), {})[r["provider"]] = r
    return cells


def fused_ops_table(block: dict) -> str:
    cells = _fused_cells(block)
    fused = [p for p in ("triton", "cuda") if any(p in c for c in cells.values())]
    same_bytes = any("copy_us" in r for c in cells.values() for r in c.values())
    head = ["op", "dtype", "shape", "MB"] + (["copy us (same bytes)"] if same_bytes else [])
    for p in fused:
        head += [f"{p} us", f"{p} GB/s", f"{p} % copy"] + ([f"{p} % same-bytes copy"] if same_bytes else [])
    head += ["eager us", "compile us"] + [f"{p} vs compile" for p in fused]
    rows = []
    for (op, dt, shape), cell in cells.items():
        any_row = next(iter(cell.values()))
        row = [op, dt, shape, _f(any_row.get("bytes", 0) / 1e6, 0)]
        if same_bytes:
            row.append(_f(any_row.get("copy_us")))
        for p in fused:
            r = cell.get(p)
            row += [_f(r["us"]), _f(r["gbps"], 0), _f(r["pct_copy"], 0, "%")] if r else ["-"] * 3
            if same_bytes:
                row.append(_f(r.get("pct_same_bytes_copy"), 0, "%") if r else "-")
        row += [_f(cell[p]["us"]) if p in cell else "-" for p in ("eager", "compile")]
        for p in fused:
            row.append(_f(cell["compile"]["us"] / cell[p]["us"], 2, "x") if p in cell and "compile" in cell else "-")
        rows.append(row)
    return _table(head, rows) + "\n" + fused_ops_summary(block)


def fused_ops_summary(block: dict, large_mb: float = 25) -> str:
    """The suite's acceptance figures, from the cells: the faster fused backend against torch.compile (geometric
    mean, per dtype, cells under 1.0x) and the cells of `large_mb` MB or more against both copy ceilings."""
    best: list[tuple[tuple, float, dict]] = []
    for key, cell in _fused_cells(block).items():
        fused = [cell[p] for p in ("triton", "cuda") if p in cell]
        if fused and "compile" in cell:
            fastest = min(fused, key=lambda r: r["us"])
            best.append((key, cell["compile"]["us"] / fastest["us"], fastest))
    if not best:
        return ""

    def geomean(values: list[float]) -> float:
        return math.exp(sum(map(math.log, values)) / len(values))

    dtypes = dict.fromkeys(k[1] for k, _, _ in best)
    under = sorted((ratio, key) for key, ratio, _ in best if ratio < 1.0)
    large = [(key, r) for key, _, r in best if r.get("bytes", 0) >= large_mb * 1e6]
    lines = [f"- The faster fused backend against torch.compile, over {len(best)} cells: geometric mean "
             f"{geomean([x for _, x, _ in best]):.2f}x ("
             + ", ".join(f"{d} {geomean([x for k, x, _ in best if k[1] == d]):.2f}x" for d in dtypes) + "); "
             f"{len(under)} cells under 1.00x"
             + (f" ({under[0][0]:.3f}x to {under[-1][0]:.3f}x: "
                + ", ".join(f"{k[0]} {k[1]} {k[2]}" for _, k in under) + ")" if under else "") + "."]
    if large:
        at_85 = sum(r["pct_copy"] >= 85 for _, r in large)
        lines.append(f"- Of the {len(large)} cells of {large_mb:g} MB or more, {at_85} reach 85% of the 1 GiB copy "
                     f"({block['summary']['copy_gbps']:.0f} GB/s).")
        same = [r["pct_same_bytes_copy"] for _, r in large if "pct_same_bytes_copy" in r]
        if same:
            lines.append(f"- Against a copy of the same bytes timed the same way, those cells reach "
                         f"{min(same):.0f}-{max(same):.0f}% (median {statistics.median(same):.0f}%); "
                         f"{sum(x >= 90 for x in same)} of {len(same)} reach 90%.")
    return "\n".join(lines) + "\n"


def nsight_table(block: dict) -> str:
    """One Nsight Compute launch per op and provider (bench.nsight)."""
    from bench.nsight import kernel_name

    rows = []
    shape = block["settings"].get("shape")
    for r in block["results"]:
        kernel = f"`{kernel_name(r['kernel'])}`" + (f" ({r['config']})" if r.get("config") else "")
        op = r["op"] + (f" ({r['shape']})" if r.get("shape") not in (None, shape) else "")
        occupancy = f"{_f(r['occupancy_pct'], 0, '%')} of {_f(r['theoretical_occupancy_pct'], 0, '%')}"
        rows.append([op, r["provider"], kernel, _f(r["us"]), _f(r["dram_pct"], 0, "%"),
                     _f(r["issue_busy_pct"], 0, "%"), occupancy, _f(r["registers"], 0), _f(r["cycles_per_issue"]),
                     _f(r["long_scoreboard_cycles"])])
    return _table(["op", "provider", "kernel", "us", "DRAM throughput", "issue slots busy",
                   "achieved occupancy (of theoretical)", "registers", "cycles between issues",
                   "of which long scoreboard"], rows)


def decoder_ops_table(block: dict) -> str:
    """One row per op, dtype and shape: each provider's us and ours against the best of torch.compile and Liger
    (the summary's vs_best_peer)."""
    ratios = block["summary"].get("vs_best_peer", {})
    providers = ("ours", "eager", "compile", "liger")
    rows = []
    for (op, dt, shape), c in _fused_cells(block).items():
        mb = next(iter(c.values()))["bytes"] / 1e6
        ratio = (ratios.get(f"{op}|{dt}|{shape}") or {}).get("vs_best_peer")
        rows.append([op, dt, shape, _f(mb, 0)] + [_f(c[p]["us"]) if p in c else "-" for p in providers] +
                    [_f(ratio, 2, "x")])
    return _table(["op", "dtype", "shape", "MB", "ours us", "eager us", "compile us", "liger us",
                   "ours vs best of compile, liger"], rows)


def gemm_table(block: dict) -> str:
    cells: dict[tuple, dict[str, dict]] = {}
    for r in block["results"]:
        if "us" in r:
            cells.setdefault((r["case"], r["dtype"], r["shape"]), {})[r["provider"]] = r
    providers = [p for p in ("triton", "cuda", "eager", "compile") if any(p in c for c in cells.values())]
    rows = []
    for (case, dt, shape), c in cells.items():
        m, k, n = shape.split("x")
        rows.append([case, dt, f"{m} x {k} -> {n}"] +
                    [f"{_f(c[p]['us'])} ({_f(c[p]['tflops'], 0)})" if p in c else "-" for p in providers])
    return _table(["case", "dtype", "M x K -> N"] + [f"{p} us (TFLOP/s)" for p in providers], rows)


def gemm_fp8_table(block: dict) -> str:
    """Per case, one layer's four GEMMs summed per provider, and the fp8 rows' largest error."""
    rows = []
    for case, layer in block["summary"].get("layers", {}).items():
        worst = max((r["rel_l2"] for r in block["results"] if r["case"] == case and "rel_l2" in r
                     and r["provider"] != "fp16"), default=None)
        rows.append([case, _f(layer["us"]["fp16"]), _f(layer["us"]["fp8"]), _f(layer["us"]["fp8 + quantize"]),
                     f"{_f(layer['fp8_speedup'], 2)}x", f"{_f(layer['fp8_quantize_speedup'], 2)}x", _f(worst, 4)])
    return _table(["case", "fp16 us", "fp8 us", "fp8 + quantize us", "fp8 speed-up", "with quantize",
                   "fp8 rel. error (worst GEMM)"], rows)


# ---- encoder ----------------------------------------------------------------------------------------------------
def encoder_label(r: dict) -> str:
    label = r["provider"]
    if r["provider"] == "ours":
        backend = r.get("backend", "auto")
        label += ("" if backend == "auto" else f" {backend}") + (" FP8" if r.get("precision") == "fp8" else "") + \
            (", CUDA graphs" if r.get("mode") == "graphs" else ", eager")
    if r.get("variant"):
        label += f" ({r['variant']})"
    return label


def _encoder_order(r: dict) -> tuple:
    providers = ("torch eager", "torch.compile", "torch.compile + CUDA graphs", "ours")
    backends = ("auto", "triton", "cuda", "torch")
    return (providers.index(r["provider"]) if r["provider"] in providers else len(providers),
            backends.index(r.get("backend", "auto")) if r.get("backend", "auto") in backends else len(backends),
            r.get("precision") == "fp8", r.get("mode") != "graphs", bool(r.get("variant")), r.get("variant") or "")


def encoder_table(blocks: dict[str, dict]) -> str:
    cases = list(blocks)
    by: dict[str, dict[str, dict]] = {}
    for case, b in blocks.items():
        for r in sorted(b["results"], key=_encoder_order):
            by.setdefault(encoder_label(r), {})[case] = r
    by = dict(sorted(by.items(), key=lambda kv: _encoder_order(next(iter(kv[1].values())))))
    rows = []
    for label, cells in by.items():
        rows.append([label] + [("failed" if "error" in cells[c] else _f(cells[c]["ms"], 3)) if c in cells else "-"
                               for c in cases])
    floors = [blocks[c]["results"][0].get("gemm_floor_ms") if blocks[c]["results"] else None for c in cases]
    rows.append(["GEMM floor (real tokens)"] + [_f(f, 3) for f in floors])
    tokens = [next((f"{r['tokens']} / {r['padded_tokens']}" for r in blocks[c]["results"] if "tokens" in r), "-")
              for c in cases]
    rows.append(["real / padded tokens"] + tokens)
    return _table(["ms per forward"] + cases, rows)


def encoder_comparison(before: dict, after: dict) -> str:
    """Two encoder results documents (an older tree's run and this one's) row by row: per case and row label in both,
    ms per forward before and after and their ratio (below 1: faster now). Rows only one of them has are listed
    with a dash for the other."""
    rows = []
    for case in [c for c in after["scenarios"] if c != "profile"] + \
            [c for c in before["scenarios"] if c != "profile" and c not in after["scenarios"]]:
        cells: dict[str, dict[str, dict]] = {}
        for side, doc in (("before", before), ("after", after)):
            for r in (doc["scenarios"].get(case) or {}).get("results", []):
                if "ms" in r:
                    cells.setdefault(encoder_label(r), {})[side] = r
        for label, pair in cells.items():
            b, a = pair.get("before"), pair.get("after")
            ratio = a["ms"] / b["ms"] if a and b else None
            rows.append([case, label, _f(b and b["ms"], 3), _f(a and a["ms"], 3), _f(ratio, 3, "x")])
    return _table(["case", "row", "before ms", "after ms", "after / before"], rows)


def profile_table(block: dict) -> str:
    rows = []
    for r in block["results"]:
        top = ", ".join(f"{k} {v:.0f}" for k, v in list(r["kernel_us"].items())[:4])
        path = f"{r['backend']}{' FP8' if r.get('precision') == 'fp8' else ''}, " \
            f"{'CUDA graphs' if r['mode'] == 'graphs' else 'eager'}" + \
            (f" ({r['variant']})" if r.get("variant") else "")
        dtype = r.get("dtype", "float16")  # the fp16 cases name no dtype; Qwen's runs in bf16
        rows.append([r["case"] + (f" ({dtype})" if dtype != "float16" else ""), path, _f(r["wall_us"], 0),
                     _f(r["kernels_per_forward"], 0), _f(r["gpu_idle_us"], 0), top,
                     _f(r.get("host_us"), 0), _f(r.get("replay_us"), 0)])
    # host_us / replay_us: a graph forward's host work (launch_ids) and its replay's device time, measured apart
    # (bench.encoder.host_and_replay_us); "-" on eager rows and in runs before they were measured
    return _table(["case", "ours", "us per forward", "kernels", "GPU idle us", "kernel us by category",
                   "host us", "replay us"], rows)


def fp8_accuracy_table(block: dict) -> str:
    rows = [[r["precision"], _f(r["min_cosine"], 5), _f(r["p01_cosine"], 5), _f(r["mean_cosine"], 6),
             _f(r["top10_overlap"], 4)] for r in block["results"] if "error" not in r]
    return _table(["precision", "held-out min cosine", "p1 cosine", "mean cosine", "top-10 overlap"], rows)


# ---- serve ------------------------------------------------------------------------------------------------------
def _pct(share: float | None) -> float | None:
    return None if share is None else 100 * share


def closed_loop_table(block: dict) -> str:
    rows = [[r["payload"], str(r["clients"]), _f(r["requests_per_s"], 0),
             _f(r["tokens_per_s"] / 1e6, 2 if r["tokens_per_s"] >= 1e5 else 4),
             _f(_pct(r["served_vs_raw"]), 0, "%"), _f(r.get("vs_sentence_transformers"), 1, "x"),
             f"{_f(r['p50_ms'])} / {_f(r['p99_ms'])}", _f(r["server"].get("cpu_ms_per_request"), 2)]
            for r in block["results"]]
    return _table(["payload", "clients", "requests/s", "M tokens/s", "% of raw", "x sentence-transformers",
                   "p50 / p99 ms", "server CPU ms/request"], rows)


def single_table(block: dict) -> str:
    rows = [[r["client"], r["route"], _f(r["p50_ms"], 2), _f(r.get("p99_ms"), 2)] for r in block["results"]]
    return _table(["client", "request", "p50 ms", "p99 ms"], rows)


def head_of_line_table(block: dict) -> str:
    rows = [[r["client"], r["beside"], str(r["requests"]), f"{_f(r['p50_ms'])} / {_f(r['p99_ms'])}",
             _f(r["max_ms"]), ", ".join(f"{k}: {v}" for k, v in r["failed"].items()) or "0"] for r in block["results"]]
    return _table(["client", "beside", "requests", "p50 / p99 ms", "max ms", "failed"], rows)


def cpu_table(block: dict) -> str:
    """The cpu scenario: one row per server configuration against sentence-transformers in-process (the summary's
    peer rates and one-text latency sit in the same block)."""
    st = block["summary"]["sentence_transformers_one_text"]
    rows = [[r["config"], r["dtype"], r["cpu_isa"] or "-", str(r["workers"]), _f(r["texts_per_s"], 1),
             _f(r["vs_sentence_transformers"], 2, "x"), f"{_f(r['one_text']['p50_ms'], 1)} / "
             f"{_f(r['one_text']['p99_ms'], 1)}", f"{_f(st['p50_ms'], 1)} / {_f(st['p99_ms'], 1)}",
             _f(r["ready_s"], 1), _f(r["min_cosine"], 6), _f(_pct(r["client_cpu_share"]), 1, "%")]
            for r in block["results"]]
    return _table(["config", "dtype", "cpu_isa", "WORKERS", "texts/s", "x sentence-transformers",
                   "one text p50 / p99 ms", "sentence-transformers one text ms", "ready s", "min cosine",
                   "client CPU"], rows)


def _sharing_table(label: str, column: str) -> Callable[[dict], str]:
    """`replicas` (servers) and `workers` (WORKERS of one server): one row per count and payload."""
    def table(block: dict) -> str:
        rows = [[str(r[label]), r.get("payload", "ids"), str(r["clients"]), _f(r["requests_per_s"], 0),
                 _f(r["tokens_per_s"] / 1e6, 2), _f(_pct(r["served_vs_raw"]), 0, "%"),
                 _f(r.get("vs_sentence_transformers"), 1, "x"), f"{_f(r['p50_ms'])} / {_f(r['p99_ms'])}",
                 _f(r["server"].get("cpu_ms_per_request"), 2)] for r in block["results"]]
        return _table([column, "payload", "clients", "requests/s", "M tokens/s", "% of raw",
                       "x sentence-transformers", "p50 / p99 ms", "server CPU ms/request"], rows)
    return table


def soak_table(block: dict) -> str:
    rows = [[str(r["clients"]), _f(r["seconds"], 0), str(r["answered"]), str(r["cancelled"]),
             ", ".join(f"{k}: {v}" for k, v in r["statuses"].items()), str(r["wrong_answers"]),
             f"{_f(r['p50_ms'], 0)} / {_f(r['p99_ms'], 0)}",
             f"{_f(r['rss_before_mib'], 0)} -> {_f(r['rss_after_mib'], 0)}"] for r in block["results"]]
    return _table(["clients", "seconds", "answered", "cancelled", "statuses", "wrong answers", "p50 / p99 ms",
                   "server RSS MiB"], rows)


def openai_load_table(block: dict) -> str:
    """Each tree's medians over its starts per point; with a baseline, this tree's over the baseline's."""
    summary = block["summary"]
    per_tree = summary.get("medians") or {}
    compared = (summary.get("comparison") or {}).get("points", {})
    rows = []
    for tree, points in per_tree.items():
        for name, m in points.items():
            c = compared.get(name) if tree == "current" else None
            rows.append([tree, name, str(m["starts"]), _f(m["requests_per_s"], 0), _f(m["texts_per_s"], 0),
                         _f(m["tokens_per_s"] / 1e3, 1), f"{_f(m['p50_ms'], 2)} / {_f(m['p99_ms'], 1)}",
                         str(m["errors"]), _percent(m.get("client_cpu_share")), _f(m.get("server_cpu_cores"), 2),
                         f"x{_f(c['requests_per_s_ratio'], 3)}, x{_f(c['tokens_per_s_ratio'], 3)}, "
                         f"{c['p50_ms_change']:+.3f} ms" + ("" if c["within_bounds"] else " **out of bounds**")
                         if c else "-"])
    table = _table(["tree", "clients x texts", "starts", "requests/s", "texts/s", "k tokens/s", "p50 / p99 ms",
                    "errors", "load generator CPU", "server cores", "vs baseline: requests/s, tokens/s, p50"], rows)
    checks = [r["reference_checks"] for r in block["results"] if r.get("reference_checks")]
    if checks:  # a run with the online reference check on (VERIFY_SAMPLE_RATE): its outcomes over every point
        total = {k: int(sum(c.get(k, 0) for c in checks)) for k in ("match", "mismatch", "error", "dropped")}
        table += (f"\nReference checks over the run: {total['match']:,} matched, {total['mismatch']:,} mismatched, "
                  f"{total['error']:,} failed, {total['dropped']:,} dropped.\n")
    return table


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"


TABLES: dict[tuple[str, str], Callable[[dict], str]] = {
    ("kernels", "fused-ops"): fused_ops_table, ("kernels", "gemm-epilogues"): gemm_table,
    ("kernels", "decoder-ops"): decoder_ops_table, ("kernels", "gemm-fp8"): gemm_fp8_table,
    ("kernels", "nsight"): nsight_table,
    ("encoder", "profile"): profile_table, ("encoder", "fp8-accuracy"): fp8_accuracy_table,
    ("serve", "closed-loop"): closed_loop_table,
    ("serve", "single"): single_table, ("serve", "replicas"): _sharing_table("replicas", "servers"),
    ("serve", "workers"): _sharing_table("workers", "WORKERS"), ("serve", "soak"): soak_table,
    ("serve", "openai-load"): openai_load_table, ("serve", "head-of-line"): head_of_line_table,
    ("serve", "cpu"): cpu_table,
}


def _renderer(suite: str, scenario: str) -> Callable[[dict], str] | None:
    """The table of a scenario, or of the scenario it is a variant of: a run stored under `--as NAME-VARIANT`
    (openai-load-fp8, nsight-fp8) renders as NAME does."""
    while scenario:
        if (suite, scenario) in TABLES:
            return TABLES[(suite, scenario)]
        scenario = scenario.rpartition("-")[0]
    return None


def _shown(path: Path) -> Path:
    """The path relative to the repository, as the docs cite it."""
    try:
        return path.resolve().relative_to(store.RESULTS.parents[1])
    except ValueError:
        return path


def tables(path: Path) -> str:
    doc = store.load(path)
    if doc is None:
        return f"{path}: not a results file\n"
    path = _shown(path)
    out = []
    from bench.encoder import CASES

    cases = {n: doc["scenarios"][n] for n in CASES if doc["suite"] == "encoder" and n in doc["scenarios"]}
    for name, b in doc["scenarios"].items():
        render = _renderer(doc["suite"], name)
        if render is None:
            continue
        out.append(_source(path, name, b) + "\n" + render(b))
    if cases:  # the encoder's cases side by side, each column its own scenario (and header)
        out.append("\n".join(_source(path, n, b) for n, b in cases.items()) + "\n" + encoder_table(cases))
    return "\n".join(out)


# ---- plots ------------------------------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_kernels(block: dict, path: Path, dtype: str = "float16") -> None:
    """Per op, achieved GB/s of each provider at each shape, against the measured copy ceiling."""
    plt = _pyplot()
    rows = [r for r in block["results"] if r.get("dtype") == dtype and "gbps" in r]
    ops = list(dict.fromkeys(r["op"] for r in rows))
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    providers = [p for p in ("triton", "cuda", "compile", "eager") if any(r["provider"] == p for r in rows)]
    ceiling = block["summary"]["copy_gbps"]
    columns = max(1, (len(ops) + 1) // 2)
    fig, axes = plt.subplots(2, columns, figsize=(5 * columns, 7), sharey=True, squeeze=False)
    width = 0.8 / max(len(providers), 1)
    for ax, op in zip(axes.flat, ops):
        for i, p in enumerate(providers):
            by_shape = {r["shape"]: r["gbps"] for r in rows if r["op"] == op and r["provider"] == p}
            ax.bar([x + i * width for x in range(len(shapes))], [by_shape.get(s, 0) for s in shapes], width, label=p)
        ax.axhline(ceiling, color="black", linewidth=1, linestyle="--")
        ax.set_title(op)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))], shapes, rotation=30, fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("GB/s")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"{block['header']['gpu'] or 'CPU'}, {dtype}: GB/s (dashed: device-to-device copy, {ceiling:.0f})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_encoder(blocks: dict[str, dict], path: Path) -> None:
    """Per case, ms per forward of each provider, ours in orange, each bar labelled with its time."""
    plt = _pyplot()
    columns = min(len(blocks), 5)  # cases wrap onto rows of five: one row of fourteen is unreadable
    rows = -(-len(blocks) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 4.6 * rows), squeeze=False)
    for ax in axes.flat[len(blocks):]:
        ax.set_visible(False)
    for ax, (case, b) in zip(axes.flat, blocks.items()):
        mine = [r for r in b["results"] if "ms" in r]
        bars = ax.barh([encoder_label(r) for r in mine], [r["ms"] for r in mine],
                       color=["tab:orange" if r["provider"] == "ours" else "tab:blue" for r in mine])
        ax.bar_label(bars, labels=[f"{r['ms']:.3f}" for r in mine], fontsize=7, padding=2)
        ax.invert_yaxis()
        ax.margins(x=0.18)
        ax.set_title(case, fontsize=9)
        ax.set_xlabel("ms per forward", fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_serve(block: dict, path: Path) -> None:
    """Served tokens/s and latency against the client count, one line per payload, with the runner's raw rate."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for payload in dict.fromkeys(r["payload"] for r in block["results"]):
        points = [r for r in block["results"] if r["payload"] == payload]
        clients = [r["clients"] for r in points]
        line, = left.plot(clients, [r["tokens_per_s"] / 1e6 for r in points], marker="o", label=payload)
        right.plot(clients, [r["p99_ms"] for r in points], marker="o", color=line.get_color(), label=f"{payload} p99")
        right.plot(clients, [r["p50_ms"] for r in points], marker=".", linestyle=":", color=line.get_color(),
                   label=f"{payload} p50")
    summary = block["summary"]
    left.axhline(summary["runner_raw_tokens_per_s"] / 1e6, color="black", linestyle="--", label="runner alone")
    if summary.get("sentence_transformers_tokens_per_s"):
        left.axhline(summary["sentence_transformers_tokens_per_s"] / 1e6, color="grey", linestyle=":",
                     label="sentence-transformers encode")
    for ax, ylabel in ((left, "M tokens/s"), (right, "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"concurrent clients ({block['settings']['per_request']} inputs per request)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    right.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sharing(block: dict, label: str, path: Path) -> None:
    """Served tokens/s as a share of the runner's raw rate against the servers (or workers) sharing the GPU, one line
    per payload."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    sharing = "CUDA MPS" if block["summary"].get("mps") else "time-sliced"
    results = block["results"]
    for payload in sorted({r.get("payload", "ids") for r in results}):
        points = sorted((r for r in results if r.get("payload", "ids") == payload), key=lambda r: r[label])
        ax.plot([r[label] for r in points], [100 * r["served_vs_raw"] for r in points], marker="o",
                label=f"{payload}, {sharing}")
        for r in points:
            ax.annotate(f"{r['requests_per_s']:.0f} req/s", (r[label], 100 * r["served_vs_raw"]),
                        textcoords="offset points", xytext=(4, -12), fontsize=7)
    what = "servers sharing one GPU" if label == "replicas" else "WORKERS of one server on one GPU"
    ax.set_xlabel(f"{what} ({results[0]['clients'] if results else '?'} clients)")
    ax.set_ylabel("served tokens/s, % of the runner alone")
    ax.set_ylim(0, 110)
    ax.margins(x=0.2)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plots(directory: Path, images: Path) -> list[Path]:
    """docs/img/{kernels,encoder,serve,replicas,workers}.png from the results in `directory`, for what it holds."""
    images.mkdir(parents=True, exist_ok=True)
    written = []
    kernels, encoder, serve = (store.load(directory / f"{s}.json") for s in ("kernels", "encoder", "serve"))
    if kernels and "fused-ops" in kernels["scenarios"]:
        plot_kernels(kernels["scenarios"]["fused-ops"], images / "kernels.png")
        written.append(images / "kernels.png")
    if encoder:
        from bench.encoder import CASES

        cases = {n: encoder["scenarios"][n] for n in CASES if n in encoder["scenarios"]}
        if cases:
            plot_encoder(cases, images / "encoder.png")
            written.append(images / "encoder.png")
    if serve and "closed-loop" in serve["scenarios"]:
        plot_serve(serve["scenarios"]["closed-loop"], images / "serve.png")
        written.append(images / "serve.png")
    for label in ("replicas", "workers"):
        if serve and label in serve["scenarios"]:
            plot_sharing(serve["scenarios"][label], label, images / f"{label}.png")
            written.append(images / f"{label}.png")
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="*", type=Path, help="results files (default: every one in bench/results/)")
    parser.add_argument("--plots-from", type=Path, default=store.RESULTS / "h200",
                        help="the results directory the plots are drawn from")
    parser.add_argument("--images", type=Path, default=Path("docs/img"), help="where the PNGs go")
    parser.add_argument("--no-plots", dest="draw", action="store_false")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"),
                        help="instead: two encoder results files side by side, row by row")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    if args.compare:
        before, after = (store.load(path) for path in args.compare)
        for path, doc in zip(args.compare, (before, after), strict=True):
            if doc is None or doc["suite"] != "encoder":
                raise SystemExit(f"{path}: not an encoder results file")
        print("\n".join(_source(path, case, block) for path, doc in zip(args.compare, (before, after), strict=True)
                        for case, block in list(doc["scenarios"].items())[:1]))
        print(encoder_comparison(before, after))
        return 0
    for path in args.files or store.committed_files():
        print(f"### {_shown(path)}\n")
        print(tables(path))
    if args.draw:
        for written in plots(args.plots_from, args.images):
            print(f"wrote {written}", file=sys.stderr)
    return 0
