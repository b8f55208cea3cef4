"""PNG plots for docs/performance.md from the benchmark JSON files (matplotlib, no display needed).

    python -m bench.plot kernels bench/results/2026-11-30-h200-kernels-cuda.json docs/img/kernels-bf16.png
    python -m bench.plot encoder bench/results/<date>-h200-encoder.json docs/img/encoder.png
    python -m bench.plot serve bench/results/<date>-h200-serve.json docs/img/serve.png
    python -m bench.plot replicas docs/img/replicas.png LABEL=bench/results/<serve>.json ...
"""

from __future__ import annotations

import json
import sys


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def kernels(report: dict, path: str, dtype: str = "bfloat16") -> None:
    """Per op, achieved GB/s of each provider at each shape, against the measured copy ceiling."""
    plt = _pyplot()
    rows = [r for r in report["results"] if r["dtype"] == dtype]
    ops = list(dict.fromkeys(r["op"] for r in rows))
    shapes = list(dict.fromkeys(f"{r['rows']}x{r['cols']}" for r in rows))
    providers = [p for p in ("triton", "cuda", "compile", "eager") if any(r["provider"] == p for r in rows)]
    fig, axes = plt.subplots(2, (len(ops) + 1) // 2, figsize=(5 * ((len(ops) + 1) // 2), 7), sharey=True)
    for ax, op in zip(axes.flat, ops):
        width = 0.8 / len(providers)
        for i, p in enumerate(providers):
            by_shape = {f"{r['rows']}x{r['cols']}": r["gbps"] for r in rows if r["op"] == op and r["provider"] == p}
            ax.bar([x + i * width for x in range(len(shapes))], [by_shape.get(s, 0) for s in shapes], width, label=p)
        ax.axhline(report["copy_gbps"], color="black", linewidth=1, linestyle="--")
        ax.axhline(0.85 * report["copy_gbps"], color="grey", linewidth=1, linestyle=":")
        ax.set_title(op)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))], shapes, rotation=30, fontsize=8)
    axes.flat[0].set_ylabel("GB/s")
    axes.flat[len(ops) // 2 if len(ops) > 1 else 0].set_ylabel("GB/s")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"{report['device']}, {dtype}: achieved GB/s (dashed: copy {report['copy_gbps']:.0f} GB/s; "
                 f"dotted: 85%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def encoder(report: dict, path: str) -> None:
    """Per case, ms per forward of each provider (log scale)."""
    plt = _pyplot()
    rows = [r for r in report["results"] if "ms" in r]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, axes = plt.subplots(1, len(cases), figsize=(4.6 * len(cases), 5))
    for ax, case in zip(axes if len(cases) > 1 else [axes], cases):
        mine = [r for r in rows if r["case"] == case]
        ax.barh([r["provider"] for r in mine], [r["ms"] for r in mine],
                color=["tab:orange" if r["provider"].startswith("ours") else "tab:blue" for r in mine])
        floor, fastest = mine[0]["gemm_floor_ms"], min(r["ms"] for r in mine)
        label = "ms per forward (log)"
        if floor >= fastest / 10:  # a floor far below every bar (launch-bound cases) would only squash the axis
            ax.axvline(floor, color="black", linestyle="--", linewidth=1)
            label += "; dashed: GEMM floor"
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(case, fontsize=9)
        ax.set_xlabel(label, fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def serve(report: dict, path: str) -> None:
    """Served tokens/s and p99 latency against the client count, one line per server configuration and payload,
    with the runner's raw rate and sentence-transformers' rate."""
    plt = _pyplot()
    series: dict[str, list[dict]] = {}
    for r in report["runs"]:  # reports before the replica sweep have neither key
        series.setdefault(f"{r.get('config', 'replicas=1')} {r.get('payload', 'text')}", []).append(r)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, runs in series.items():
        clients = [r["clients"] for r in runs]
        line, = left.plot(clients, [r["tokens_per_s"] / 1e6 for r in runs], marker="o", label=label)
        right.plot(clients, [r["p99_ms"] for r in runs], marker="o", color=line.get_color(), label=f"{label} p99")
        right.plot(clients, [r["p50_ms"] for r in runs], marker=".", linestyle=":", color=line.get_color())
    left.axhline(report["runner_raw_tokens_per_s"] / 1e6, color="black", linestyle="--", label="runner raw")
    left.axhline(0.85 * report["runner_raw_tokens_per_s"] / 1e6, color="black", linestyle=":", label="85% of raw")
    if report.get("sentence_transformers_fp16_tokens_per_s"):  # none for a random-init preset
        left.axhline(report["sentence_transformers_fp16_tokens_per_s"] / 1e6, color="grey", linestyle=":",
                     label="sentence-transformers fp16")
    for ax, ylabel in ((left, "M tokens/s"), (right, "ms (p99 solid, p50 dotted)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients (16 texts per request)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    right.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def replicas(reports: dict[str, dict], path: str, clients: int = 64) -> None:
    """Served tokens/s as a share of each run's own raw runner rate against the number of servers sharing the GPU,
    one line per labelled bench.serve report (e.g. time-sliced vs MPS), at one client count, with the 85% target."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for label, report in reports.items():
        runs = sorted((r for r in report["runs"] if r["clients"] == clients and r.get("payload", "ids") == "ids"),
                      key=lambda r: r["replicas"])
        ax.plot([r["replicas"] for r in runs], [100 * r["served_vs_raw"] for r in runs], marker="o", label=label)
        for r in runs:
            ax.annotate(f"{r['requests_per_s']:.0f} req/s", (r["replicas"], 100 * r["served_vs_raw"]),
                        textcoords="offset points", xytext=(4, -12), fontsize=7)
    ax.axhline(85, color="black", linestyle=":", label="target: 85% of raw")
    ax.set_xlabel(f"servers sharing one GPU ({clients} clients, 16 token-id rows per request)")
    ax.set_ylabel("served tokens/s, % of the same run's raw runner")
    ax.set_ylim(0, 110)
    ax.margins(x=0.12)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 3 and argv[0] == "replicas" and all("=" in a for a in argv[2:]):
        reports = {}
        for spec in argv[2:]:
            label, source = spec.split("=", 1)
            with open(source) as f:
                reports[label] = json.load(f)
        replicas(reports, argv[1])
        print(argv[1])
        return 0
    if len(argv) != 3 or argv[0] not in ("kernels", "encoder", "serve"):
        print(__doc__, file=sys.stderr)
        return 2
    kind, source, target = argv
    with open(source) as f:
        report = json.load(f)
    {"kernels": kernels, "encoder": encoder, "serve": serve}[kind](report, target)
    print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
