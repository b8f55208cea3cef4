"""The serving suite's `frontends` scenario: the process models side by side in one run, driven by openai-load's
clients (aiohttp in load-generator processes of their own, POST /v1/embeddings with float JSON vectors).

Each configuration of --frontends-configs is one server: `workers=N` (N full server processes on the device, the
model copied into each; `auto` under CUDA MPS where its daemon runs) or `frontends=N` (N front-ends in front of one
engine per device, one model copy). Per configuration and point (--frontends-points, CLIENTSxTEXTS): requests/s,
texts/s, tokens/s, p50/p99, and the CPU each side took: the load generator's share of the host and the server's
cores and CPU ms per request (every process of the server, the engines included: fusedserve_worker_cpu_seconds).
The summary holds each configuration's points over the first configuration's (the baseline, `workers=auto` by
default). The tokenizer's single-thread rate per core on the same corpus is measured alongside (the bound of text
in, once the host path is out of the way).
"""

from __future__ import annotations

import argparse
import sys
import time

from bench.harness import ClientProcesses, extra_settings, log_path, running_servers, traffic
from bench.openai_load import point, point_name, point_row, run_point


def config(text: str) -> tuple[str, str]:
    """`workers=auto`, `frontends=4` -> (setting, value)."""
    key, _, value = text.partition("=")
    if key not in ("workers", "frontends") or not value:
        raise argparse.ArgumentTypeError(f"{text!r}: give workers=N|auto or frontends=N|auto")
    return key, value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--frontends-configs", type=config, nargs="+", metavar="SETTING=N",
                        default=[("workers", "auto"), *(("frontends", str(n)) for n in (1, 2, 4, 8, 12))],
                        help="frontends: the servers, one each (the first is the baseline of the ratios)")
    parser.add_argument("--frontends-points", type=point, nargs="+", default=[(64, 1), (256, 1), (64, 16)],
                        metavar="CLIENTSxTEXTS", help="frontends: the points of every configuration")


def settings(args: argparse.Namespace) -> dict:
    return {"configs": [f"{k}={v}" for k, v in args.frontends_configs],
            "points": [point_name(*p) for p in args.frontends_points], "encoding_format": "float",
            "warm_seconds": args.warm_seconds, "server": server_settings(args)}


def server_settings(args: argparse.Namespace) -> dict[str, str]:
    return {"model": args.model, "device": args.device, "dtype": args.dtype, **extra_settings(args)}


def tokenizer_rate(args: argparse.Namespace, texts: list[str], seconds: float = 3.0) -> dict:
    """The `tokenizers` rate of one thread on the corpus, in tokens/s per core: the model's own tokenizer file (as
    its description names it to the front-ends), one text a call (no thread pool)."""
    from tokenizers import Tokenizer

    from fusedserve.model import load
    from fusedserve.model.api import LoadOptions

    spec = load(args.model, LoadOptions(device="cpu", dtype="float32")).describe().text
    tokenizer = Tokenizer.from_file(spec.tokenizer)
    tokens, done, started = 0, 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        tokens += len(tokenizer.encode(texts[done % len(texts)]).ids)
        done += 1
    elapsed = time.perf_counter() - started
    return {"texts": done, "tokens_per_s_per_core": tokens / elapsed}


def frontends_scenario(args: argparse.Namespace, save) -> None:
    texts = traffic(args, low=5)
    rows: list[dict] = []
    summary: dict = {"texts": len(texts), "client_processes": args.client_processes,
                     "tokenizer": tokenizer_rate(args, texts)}
    with ClientProcesses(max(1, args.client_processes)) as pool:
        for key, value in args.frontends_configs:
            name = f"{key}={value}"
            with running_servers(1, log_path(args, f"frontends-{key}-{value}"), **server_settings(args),
                                 **{key: value}) as servers:
                url = servers[0][1]
                for clients, per_request in args.frontends_points:
                    if args.warm_seconds > 0:
                        run_point(pool, url, texts, clients, per_request, args.warm_seconds)
                    run = run_point(pool, url, texts, clients, per_request, args.seconds, metrics_url=url)
                    rows.append(point_row(run, clients, per_request, config=name))
                    _say(rows[-1])
                    save(rows, summary, False)
    summary["ratios"] = ratios(rows)
    print(table(rows, summary["ratios"]), file=sys.stderr, flush=True)
    save(rows, summary, True)


def ratios(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Each configuration's requests/s over the first configuration's, per point."""
    if not rows:
        return {}
    first = rows[0]["config"]
    base = {r["point"]: r["requests_per_s"] for r in rows if r["config"] == first}
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        if r["config"] != first and base.get(r["point"]):
            out.setdefault(r["config"], {})[r["point"]] = r["requests_per_s"] / base[r["point"]]
    return out


def _say(row: dict) -> None:
    print(f"[frontends] {row['config']}, {row['point']}: {row['requests_per_s']:.0f} requests/s, "
          f"{row['tokens_per_s']:.0f} tokens/s, p50 {row['p50_ms']:.2f} ms, p99 {row['p99_ms']:.2f} ms, "
          f"{row['errors']} errors; load generator {row['client_cpu_share']:.0%} of the CPUs, server "
          f"{row.get('server_cpu_cores', 0):.2f} cores, {row.get('server_cpu_ms_per_request', 0):.2f} CPU ms a request",
          file=sys.stderr, flush=True)


def table(rows: list[dict], ratios_: dict) -> str:
    lines = [f"{'config':<13} {'point':>6} {'requests/s':>10} {'tokens/s':>10} {'p50 ms':>7} {'p99 ms':>7} "
             f"{'server cores':>12} {'CPU ms/req':>10} {'client CPU':>10} {'x first':>7}"]
    for r in rows:
        ratio = ratios_.get(r["config"], {}).get(r["point"])
        lines.append(f"{r['config']:<13} {r['point']:>6} {r['requests_per_s']:>10.0f} {r['tokens_per_s']:>10.0f} "
                     f"{r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f} {r.get('server_cpu_cores', 0):>12.2f} "
                     f"{r.get('server_cpu_ms_per_request', 0):>10.2f} {r['client_cpu_share']:>10.0%} "
                     f"{'' if ratio is None else f'{ratio:.2f}':>7}")
    return "\n".join(lines)
