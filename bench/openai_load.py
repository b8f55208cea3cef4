"""The serving suite's `openai-load` scenario: one server driven through POST /v1/embeddings (float JSON) by aiohttp
clients in load-generator processes of their own, over a corpus of 5-200-word texts; and, with --baseline, the same
workload against an older tree's server in the same session, started in turn with this tree's, side by side.

Each point is CLIENTSxTEXTS (--openai-points): closed-loop clients, each on its own connection, sending TEXTS texts a
request; 1x1 is one client's sequential single requests. A point reports requests/s, texts/s, tokens/s (the
`usage.prompt_tokens` of the answers: what the server ran) and p50/p99 over the requests answered in --seconds, after
--warm-seconds of the same load. The servers run the project's defaults (what a deployment gets) with --model,
--device, --dtype and any --setting.

With --baseline DIR (an older commit's fusedserve installed in DIR by `python -m bench.gpu_assets --baseline`, its
server `python -m fusedserve serve` from DIR), each tree's server is started --starts times, in rounds that
alternate the two in an order reversed every round (baseline first, then this tree first, ...), so a drift through
the session falls on both alike; the summary
holds each tree's medians over its starts per point and this tree's over the baseline's: throughput ratios at
several clients (at least 1 - --max-throughput-loss) and the p50 change of the one-client point (at most
--max-p50-increase-ms). Before the numbers count, both trees embed the same check texts and must agree.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench import results as store
from bench.harness import (CHECK_RESULTS, CURRENT, SAME_MODEL_MIN_COSINE, ClientProcesses, client_shares, extra_settings, free_port,
                           log_path, merge_runs, min_cosine, one_connection_session, percentiles_ms, running_servers,
                           sentences, server_sums, settled_sums, traffic, tree_launch)

ROUTE = "/v1/embeddings"
POINT_METRICS = ("requests_per_s", "texts_per_s", "tokens_per_s", "p50_ms", "p99_ms", "client_cpu_share",
                 "server_cpu_cores")
THROUGHPUT = ("requests_per_s", "texts_per_s", "tokens_per_s")


def point(text: str) -> tuple[int, int]:
    """'64x16' -> (64 clients, 16 texts a request)."""
    try:
        clients, per_request = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not CLIENTSxTEXTS, e.g. 64x16") from None
    if clients < 1 or per_request < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: clients and texts a request are at least 1")
    return clients, per_request


def point_name(clients: int, per_request: int) -> str:
    return f"{clients}x{per_request}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--openai-points", type=point, nargs="+", default=[(1, 1), (64, 1), (64, 16)],
                        metavar="CLIENTSxTEXTS", help="openai-load: clients x texts a request, one point each")
    parser.add_argument("--grpc-points", type=point, nargs="*", default=[], metavar="CLIENTSxTEXTS",
                        help="openai-load: the same texts through this tree's KServe v2 gRPC service (ModelInfer, "
                             "BYTES in, raw FP32 out), beside the HTTP points; tokens are not reported by gRPC")
    parser.add_argument("--warm-seconds", type=float, default=2.0,
                        help="openai-load: seconds of each point's load before its measured --seconds")
    parser.add_argument("--baseline", metavar="DIR",
                        help="openai-load: an older tree's fusedserve installed in DIR (bench.gpu_assets --baseline), "
                             "started in turn with this tree's; the summary compares the two")
    parser.add_argument("--starts", type=int,
                        help="openai-load: server starts per tree (default 3 with --baseline, else 1)")
    parser.add_argument("--max-throughput-loss", type=float, default=0.03,
                        help="openai-load --baseline: the largest share of the baseline's throughput this tree may "
                             "lose at several clients")
    parser.add_argument("--max-p50-increase-ms", type=float, default=0.1,
                        help="openai-load --baseline: the most this tree's one-client p50 may exceed the baseline's")


def starts(args: argparse.Namespace) -> int:
    return args.starts or (3 if args.baseline else 1)


def server_settings(args: argparse.Namespace) -> dict[str, str]:
    """The project's defaults but for the model, device and dtype, plus any --setting."""
    return {"model": args.model, "device": args.device, "dtype": args.dtype, **extra_settings(args)}


def settings(args: argparse.Namespace) -> dict:
    """What the results block records as this scenario's settings."""
    return {"points": [point_name(*p) for p in args.openai_points],
            "grpc_points": [point_name(*p) for p in args.grpc_points], "route": ROUTE, "encoding_format": "float",
            "warm_seconds": args.warm_seconds, "starts": starts(args), "baseline": args.baseline,
            "server": server_settings(args), "corpus_words": [min(5, args.max_words), args.max_words],
            "bounds": {"max_throughput_loss": args.max_throughput_loss,
                       "max_p50_increase_ms": args.max_p50_increase_ms}}


def start_order(trees: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, tree) for every start: each round starts every tree once, in an order reversed every round."""
    return [(r, tree) for r in range(rounds) for tree in (trees if r % 2 == 0 else trees[::-1])]


async def openai_clients(url: str, texts: list[str], clients: int, seconds: float, per_request: int,
                         seed: int, encoding: str = "float") -> dict:
    """`clients` aiohttp sessions of one connection each, each sending its next POST /v1/embeddings (`per_request`
    texts picked at random, vectors as `encoding`: float JSON or base64) when the last is answered, for `seconds`. An
    answer counts when it is a 200 holding one vector per text; its `usage.prompt_tokens` adds to the tokens. Runs in
    a load-generator process."""
    import aiohttp

    latencies: list[float] = []
    errors = tokens = 0
    rng = random.Random(seed)
    stop = time.monotonic() + seconds

    async def client_loop() -> None:
        nonlocal errors, tokens
        async with one_connection_session(url) as session:
            while time.monotonic() < stop:
                body = {"input": [texts[rng.randrange(len(texts))] for _ in range(per_request)],
                        "encoding_format": encoding}
                t = time.perf_counter()
                try:
                    async with session.post(ROUTE, json=body) as response:
                        status, payload = response.status, await response.read()
                except aiohttp.ClientError as exc:  # counted, and the run goes on: the row says how many
                    errors += 1
                    print(f"client error: {type(exc).__name__}: {exc}", file=sys.stderr)
                    await asyncio.sleep(0.1)  # back off a server that refuses connections
                    continue
                elapsed = time.perf_counter() - t
                answer = json.loads(payload) if status == 200 else None
                if answer is None or len(answer.get("data", ())) != per_request:
                    errors += 1
                    continue
                latencies.append(elapsed)
                tokens += answer["usage"]["prompt_tokens"]

    started, cpu = time.monotonic(), time.process_time()
    await asyncio.gather(*(client_loop() for _ in range(clients)))
    return {"latencies": latencies, "errors": errors, "elapsed": time.monotonic() - started, "tokens": tokens,
            "cpu": time.process_time() - cpu}


async def grpc_clients(target: str, texts: list[str], clients: int, seconds: float, per_request: int,
                       seed: int) -> dict:
    """As openai_clients, over gRPC: `clients` channels to `target` (host:port), each sending its next ModelInfer
    (`per_request` texts, raw BYTES) when the last is answered. An answer counts when it holds one vector per text."""
    import grpc

    from fusedserve.server.kserve_grpc import SERVICE, _message

    request_type, response_type = _message("ModelInferRequest"), _message("ModelInferResponse")
    latencies: list[float] = []
    errors = 0
    rng = random.Random(seed)
    stop = time.monotonic() + seconds
    encoded = [t.encode() for t in texts]

    async def client_loop() -> None:
        nonlocal errors
        async with grpc.aio.insecure_channel(target) as channel:
            infer = channel.unary_unary(f"/{SERVICE}/ModelInfer", request_serializer=request_type.SerializeToString,
                                        response_deserializer=response_type.FromString)
            while time.monotonic() < stop:
                picked = [encoded[rng.randrange(len(encoded))] for _ in range(per_request)]
                request = request_type(model_name="")
                request.inputs.add(name="text", datatype="BYTES", shape=[per_request])
                request.raw_input_contents.append(b"".join(len(b).to_bytes(4, "little") + b for b in picked))
                t = time.perf_counter()
                try:
                    response = await infer(request, timeout=120)
                except grpc.aio.AioRpcError as exc:
                    errors += 1
                    print(f"client error: {exc.code()}: {exc.details()}", file=sys.stderr)
                    await asyncio.sleep(0.1)
                    continue
                elapsed = time.perf_counter() - t
                if list(response.outputs[0].shape)[:1] != [per_request]:
                    errors += 1
                    continue
                latencies.append(elapsed)

    started, cpu = time.monotonic(), time.process_time()
    await asyncio.gather(*(client_loop() for _ in range(clients)))
    return {"latencies": latencies, "errors": errors, "elapsed": time.monotonic() - started, "tokens": 0,
            "cpu": time.process_time() - cpu}


def run_point(pool: ClientProcesses, url: str, texts: list[str], clients: int, per_request: int,
              seconds: float, clients_fn=openai_clients, metrics_url: str | None = None,
              encoding: str = "float") -> dict:
    """One closed-loop run of `clients` over the pool's processes, all started together; with metrics_url (the
    server's HTTP address), the server's CPU seconds over the run too (its /metrics before and after: every worker's
    process). encoding: the HTTP clients' vectors (float or base64)."""
    extra = (encoding,) if clients_fn is openai_clients else ()
    jobs = [(url, texts, n, seconds, per_request, 1 + i, *extra)
            for i, n in enumerate(client_shares(clients, len(pool)))]
    before = server_sums(metrics_url, ROUTE) if metrics_url else None
    run = merge_runs(pool.run(clients_fn, jobs, timeout_s=seconds + 300))
    if before is not None:
        after = settled_sums(metrics_url, ROUTE)
        run["server_cpu"] = after["cpu"] - before["cpu"]
        checks = {result: after[f"checks_{result}"] - before[f"checks_{result}"] for result in CHECK_RESULTS}
        if any(checks.values()):  # VERIFY_SAMPLE_RATE set: how the sampled batches of this point compared
            run["reference_checks"] = checks
    return run


def point_row(run: dict, clients: int, per_request: int, prefix: str = "", **labels) -> dict:
    """A point's numbers, with the CPU the load generator and the server took over it: in cores, and as a share of
    the machine's (the two share one host)."""
    latencies, elapsed, cores = run["latencies"], run["elapsed"], os.cpu_count() or 1
    cpu = {"client_cpu_cores": run["cpu"] / elapsed, "client_cpu_share": run["cpu"] / elapsed / cores}
    if "server_cpu" in run:
        cpu.update(server_cpu_cores=run["server_cpu"] / elapsed, server_cpu_share=run["server_cpu"] / elapsed / cores,
                   server_cpu_ms_per_request=1e3 * run["server_cpu"] / max(len(latencies), 1))
    return {**labels, "point": prefix + point_name(clients, per_request), "clients": clients,
            "per_request": per_request,
            "requests": len(latencies), "errors": run["errors"], "seconds": elapsed,
            "requests_per_s": len(latencies) / elapsed, "texts_per_s": len(latencies) * per_request / elapsed,
            "tokens_per_s": run["tokens"] / elapsed, **percentiles_ms(latencies), **cpu,
            **({"reference_checks": run["reference_checks"]} if "reference_checks" in run else {})}


def medians(rows: list[dict]) -> dict[str, dict[str, dict]]:
    """tree -> point -> each metric's median over that tree's starts (and how many starts it is over)."""
    grouped: dict[str, dict[str, list[dict]]] = {}
    for row in rows:
        grouped.setdefault(row["tree"], {}).setdefault(row["point"], []).append(row)
    return {tree: {name: {"starts": len(runs), "clients": runs[0]["clients"], "per_request": runs[0]["per_request"],
                          "errors": sum(r["errors"] for r in runs),
                          **{m: statistics.median(r[m] for r in runs) for m in POINT_METRICS}}
                   for name, runs in points.items()}
            for tree, points in grouped.items()}


def comparison(per_tree: dict[str, dict[str, dict]], max_throughput_loss: float, max_p50_increase_ms: float) -> dict:
    """Per point, this tree's medians over the baseline's: throughput ratios (above 1: more served) and the change
    of p50 and p99 in ms (below 0: answered sooner). A point of several clients is within bounds when every
    throughput ratio is at least 1 - max_throughput_loss; the one-client point when its p50 grew by at most
    max_p50_increase_ms. Neither tree may have answered with an error."""
    before, after = per_tree.get("baseline", {}), per_tree.get("current", {})
    points = {}
    for name in [n for n in after if n in before]:
        b, a = before[name], after[name]
        entry = {f"{m}_ratio": a[m] / b[m] if b[m] else None for m in THROUGHPUT}
        entry.update(p50_ms_change=a["p50_ms"] - b["p50_ms"], p99_ms_change=a["p99_ms"] - b["p99_ms"])
        if a["clients"] == 1:
            entry["within_bounds"] = entry["p50_ms_change"] <= max_p50_increase_ms
        else:
            entry["within_bounds"] = all(entry[f"{m}_ratio"] is not None and
                                         entry[f"{m}_ratio"] >= 1 - max_throughput_loss for m in THROUGHPUT)
        entry["within_bounds"] = entry["within_bounds"] and a["errors"] == b["errors"] == 0
        points[name] = entry
    return {"points": points, "no_regression": bool(points) and all(p["within_bounds"] for p in points.values())}


def tree_source(root: str | Path | None) -> dict:
    """The commit a tree was exported from: its source.json (bench.gpu_assets --baseline writes one), else git."""
    if root is None:
        sha, dirty = store.git_source()
        return {"git_sha": sha, "git_dirty": dirty}
    stamp = Path(root) / "source.json"
    if stamp.is_file():
        return json.loads(stamp.read_text())
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True,
                             timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = None
    return {"git_sha": sha, "git_dirty": None}


def check_vectors(url: str, texts: list[str]) -> list[list[float]]:
    r = httpx.post(url + ROUTE, json={"input": texts, "encoding_format": "float"}, timeout=120)
    r.raise_for_status()
    return [item["embedding"] for item in sorted(r.json()["data"], key=lambda item: item["index"])]


def _say(row: dict) -> None:
    print(f"[openai-load] {row['tree']} start {row['start'] + 1}, {row['point']}: {row['requests_per_s']:.0f} "
          f"requests/s, {row['texts_per_s']:.0f} texts/s, {row['tokens_per_s']:.0f} tokens/s, p50 "
          f"{row['p50_ms']:.2f} ms, p99 {row['p99_ms']:.2f} ms, {row['errors']} errors; load generator "
          f"{row['client_cpu_share']:.0%} of the CPUs, server {row['server_cpu_cores']:.2f} cores", file=sys.stderr,
          flush=True)


def table(per_tree: dict[str, dict[str, dict]], compared: dict | None) -> str:
    lines = [f"{'tree':<9} {'point':>6} {'starts':>6} {'requests/s':>10} {'texts/s':>9} {'tokens/s':>10} "
             f"{'p50 ms':>8} {'p99 ms':>8} {'errors':>6} {'client CPU':>10} {'server cores':>12}"]
    for tree, points in per_tree.items():
        for name, m in points.items():
            lines.append(f"{tree:<9} {name:>6} {m['starts']:>6} {m['requests_per_s']:>10.1f} {m['texts_per_s']:>9.1f} "
                         f"{m['tokens_per_s']:>10.0f} {m['p50_ms']:>8.2f} {m['p99_ms']:>8.2f} {m['errors']:>6} "
                         f"{m['client_cpu_share']:>10.0%} {m['server_cpu_cores']:>12.2f}")
    for name, c in (compared or {}).get("points", {}).items():
        lines.append(f"{name}: current/baseline requests/s x{c['requests_per_s_ratio']:.3f}, tokens/s "
                     f"x{c['tokens_per_s_ratio']:.3f}, p50 {c['p50_ms_change']:+.3f} ms, p99 "
                     f"{c['p99_ms_change']:+.2f} ms: {'within bounds' if c['within_bounds'] else 'OUT OF BOUNDS'}")
    return "\n".join(lines)


def openai_load_scenario(args: argparse.Namespace, save) -> None:
    texts = traffic(args, low=5)
    launches = {"current": CURRENT}
    if args.baseline:
        launches = {"baseline": tree_launch(args.baseline), **launches}
    # the shortest and the longest texts of the corpus: both trees must give the same vectors for them
    check = sentences(2, 5) + sorted(texts, key=len)[-2:]
    summary: dict = {"texts": len(texts), "client_processes": args.client_processes,
                     "trees": {name: {"command": " ".join(launch.argv[1:]), "dir": launch.cwd,
                                      "source": tree_source(launch.cwd)} for name, launch in launches.items()}}
    rows: list[dict] = []
    vectors: dict[str, list] = {}
    with ClientProcesses(max(1, args.client_processes)) as pool:
        for start, tree in start_order(list(launches), starts(args)):
            grpc_port = str(free_port()) if tree == "current" and args.grpc_points else None
            with running_servers(1, log_path(args, f"openai-load-{tree}-{start + 1}"), launch=launches[tree],
                                 **server_settings(args), **({"grpc_port": grpc_port} if grpc_port else {})) \
                    as servers:
                url = servers[0][1]
                if tree not in vectors:
                    vectors[tree] = check_vectors(url, check)
                    summary["trees"][tree]["info"] = httpx.get(url + "/info", timeout=30).json()
                if len(vectors) == 2 and "same_model_min_cosine" not in summary:
                    cosine = summary["same_model_min_cosine"] = min_cosine(*vectors.values())
                    if not cosine > SAME_MODEL_MIN_COSINE:
                        raise RuntimeError(f"the baseline's embeddings differ from this tree's (lowest cosine "
                                           f"{cosine:.6f}): the two do not serve the same model")
                for clients, per_request in args.openai_points:
                    if args.warm_seconds > 0:
                        run_point(pool, url, texts, clients, per_request, args.warm_seconds)
                    run = run_point(pool, url, texts, clients, per_request, args.seconds, metrics_url=url)
                    rows.append(point_row(run, clients, per_request, tree=tree, start=start))
                    _say(rows[-1])
                    save(rows, summary, False)
                for clients, per_request in args.grpc_points if grpc_port else ():
                    target = f"127.0.0.1:{grpc_port}"
                    if args.warm_seconds > 0:
                        run_point(pool, target, texts, clients, per_request, args.warm_seconds, grpc_clients)
                    run = run_point(pool, target, texts, clients, per_request, args.seconds, grpc_clients,
                                    metrics_url=url)
                    rows.append(point_row(run, clients, per_request, "grpc-", tree=tree, start=start))
                    _say(rows[-1])
                    save(rows, summary, False)
    summary["medians"] = medians(rows)
    if args.baseline:
        summary["comparison"] = comparison(summary["medians"], args.max_throughput_loss, args.max_p50_increase_ms)
    print(table(summary["medians"], summary.get("comparison")), file=sys.stderr, flush=True)
    save(rows, summary, True)

