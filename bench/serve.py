"""Serving suite: the real server (`fusedserve serve` on 127.0.0.1) under load from HTTP clients on the same host.

Scenarios:
  closed-loop  N concurrent clients, each sending its next request when the last is answered, at each client count
               and payload ("text": texts to POST /infer, tokenized by the server; "ids": token ids to
               POST /v1/embeddings with base64 vectors, as a client that tokenizes itself sends them), against the
               runner alone on the same traffic (raw tokens/s, the ceiling) and sentence-transformers' own batched
               encode on the same texts, same run; with the server's own account of where a request's time went
  single       one client, one request at a time: latency from httpx and from http.client, the server's share of
               it and a GET /healthz round trip as the HTTP floor
  workers      one server with WORKERS=n processes on its port (under CUDA MPS when its daemon runs), token ids
               at a fixed client count: served tokens/s against the runner's raw rate, per n
  replicas     the same with n separate servers started side by side (as pods share a GPU), each on its port
  soak         many clients of mixed-length requests, some giving up early, for a long run: every answer checked
               against its input's single-request embedding, status counts, the server's memory growth
  startup      time to ready on an empty cache directory and again on the cache it left, and the first 1,000
               sequential single requests after the cold start
  peer         Infinity (infinity-emb 0.0.78, torch engine, its best of --peer-batch-sizes) beside one server of ours,
               same run, same model directory and texts, the same OpenAI request (POST /v1/embeddings, base64) from
               the same clients, at each of --peer-clients: tokens/s, texts/s, p50/p99 and ours/Infinity per count
               (bench/peer.py). Infinity's wheels: `bash bench/peer-wheels.sh` (-> .whl-infinity/), installed with
               pip's --target into the folder --infinity-site names
  head-of-line one client sending a one-input request every --gap-ms, first alone, then while another sends the
               largest requests the limits allow (max_client_batch inputs of max_request_chars in all) back to back:
               the one input's p50/p99 beside the large requests', at the server's default batch limits
  cpu          the CPU device only: sentence-transformers in-process (and its ONNX backend where it runs; its
               OpenVINO backend, default and f32 hint, in a venv of its own) against the server on the same cores,
               fp32 / bfloat16 / WORKERS=2, same run and texts, --rounds alternating rounds: texts/s and CPU ms per
               text (median, min, max), one text at a time, time to ready, cosine on held-out texts
               (bench/cpu_peers.py)
  openai-load  POST /v1/embeddings (float JSON) from aiohttp clients in load-generator processes of their own, at
               each of --openai-points (CLIENTSxTEXTS; 1x1 is single sequential requests), over 5-200-word texts;
               with --baseline DIR, an older tree's server started in turn with ours, the medians of --starts starts
               side by side with their ratios (bench/openai_load.py)
  frontends    the process models side by side: WORKERS=auto and FRONTENDS=1, 2, 4, 8, 12 (one engine per device),
               openai-load's clients at 64x1, 256x1 and 64x16, the CPU of each side per point, ratios over the first
               configuration, and the tokenizer's one-thread rate on the corpus (bench/frontends_load.py)
  devices      two GPUs or more: one server on every GPU against one pinned to one GPU and half the CPUs, both
               WORKERS=auto, openai-load's clients; per-device busy time and tokens; then one device's workers
               killed under load: failed and wrong answers, the rejoin time (bench/devices_load.py)
  m3           a BGE-M3-shaped directory (XLM-RoBERTa-large's shape, random weights, built once; or --m3-model)
               served: POST /v1/embeddings at each of --m3-points in four request shapes taking turns (dense only,
               the three outputs of one forward, the three as three requests, sparse only): requests/s, texts/s,
               tokens/s, p50/p99, response bytes and each side's CPU, with all-in-one's tokens/s over dense's and
               over three requests' (bench/m3_load.py)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import http.client
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench import cpu_peers, devices_load, frontends_load, m3_load, openai_load, peer
from bench import results as store
from bench.harness import (load, log_path, mixed_texts, on_cuda, one_connection_session, percentiles_ms, request_body,
                           running_servers, sentences, server_breakdown, server_settings, server_sums, settled_sums,
                           traffic)

SCENARIOS = ("closed-loop", "single", "workers", "replicas", "soak", "startup", "peer", "openai-load", "devices",
             "head-of-line", "cpu", "frontends", "m3")
DEFAULT_SCENARIOS = ("closed-loop", "single", "workers")


def kernel_choices(urls: list[str]) -> dict[str, dict[str, int]]:
    """Per op, how many of the servers chose each backend (their /info): replicas starting together on one GPU race
    their kernels beside each other's start-up work, so they may choose differently."""
    counts: dict[str, collections.Counter] = {}
    for url in urls:
        for op, choice in httpx.get(url + "/info").json()["kernels"].items():
            counts.setdefault(op, collections.Counter())[choice["backend"]] += 1
    return {op: dict(c) for op, c in counts.items()}


def measured_load(urls: str | list[str], rows: list, clients: int, seconds: float, per_request: int,
                  count_tokens: list[int], processes: int = 1, payload: str = "text") -> tuple[dict, dict]:
    """One closed-loop run (load) and the servers' own account of it (server_breakdown of their /metrics before and
    after, on the payload's route): (run, inside)."""
    route = request_body(payload, [])[0]
    before = server_sums(urls, route)
    run = load(urls, rows, clients, seconds, per_request, count_tokens, processes, payload)
    return run, server_breakdown(before, settled_sums(urls, route), run["elapsed"])


def single_requests(url: str, texts: list[str], count: int = 200, warm: int = 20) -> dict:
    """One client sending one request at a time to /infer: its latency (p50, p99, mean), the server's own account of
    the same requests (server_breakdown over them: time in the server, queued, forward) and an HTTP floor (GET
    /healthz round trips on the same connection), so the latency splits into client + HTTP, server work, forward."""
    with httpx.Client(base_url=url, timeout=30) as client:
        for _ in range(warm):
            client.post("/infer", json={"inputs": texts}).raise_for_status()
        before, started, latencies = server_sums(url), time.monotonic(), []
        for _ in range(count):
            t = time.perf_counter()
            client.post("/infer", json={"inputs": texts}).raise_for_status()
            latencies.append(time.perf_counter() - t)
        inside = server_breakdown(before, settled_sums(url), time.monotonic() - started)
        floor = []
        for _ in range(count):
            t = time.perf_counter()
            client.get("/healthz").raise_for_status()
            floor.append(time.perf_counter() - t)
    raw = raw_client_latency(url, texts, count)
    return {"requests": count, **percentiles_ms(latencies),
            "mean_ms": statistics.fmean(latencies) * 1e3, "server": inside,
            "healthz_p50_ms": statistics.median(floor) * 1e3, "raw_client": raw}


def raw_client_latency(url: str, texts: list[str], count: int = 200, warm: int = 20) -> dict:
    """The same requests from the standard library's http.client on one keep-alive connection: a client that costs
    far less per request than httpx, so the server's own latency shows through."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"inputs": texts}).encode()
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    out = {}
    for name, method, path, payload in (("infer", "POST", "/infer", body), ("healthz", "GET", "/healthz", None)):
        latencies = []
        for i in range(warm + count):
            t = time.perf_counter()
            connection.request(method, path, payload, {"Content-Type": "application/json"} if payload else {})
            response = connection.getresponse()
            response.read()
            if response.status != 200:
                raise RuntimeError(f"{method} {path}: HTTP {response.status}")
            latencies.append(time.perf_counter() - t)
        out.update({f"{name}_{k}": v for k, v in percentiles_ms(latencies[warm:]).items()})
    connection.close()
    return out


# ---- the scenarios ----------------------------------------------------------------------------------------------
def _batches(ids: list[list[int]], max_batch: int, max_tokens: int) -> list[list[list[int]]]:
    """The token-id rows in length-sorted batches under the servers' limits (what their batcher forms: packed
    batches are budgeted by their real tokens)."""
    batches, current, tokens = [], [], 0
    for row in sorted(ids, key=len):
        if current and (len(current) >= max_batch or tokens + len(row) > max_tokens):
            batches.append(current)
            current, tokens = [], 0
        current.append(row)
        tokens += len(row)
    return batches + [current]


def raw_runner(args: argparse.Namespace, texts: list[str]) -> tuple[list[list[int]], float]:
    """(token ids of `texts`, the runner's own tokens/s on them): model.runner.Embedder in this process (on the
    servers' kernel backend setting), the same batches the servers would form, back to back; the ceiling a server's
    served rate is held against."""
    from fusedserve.model.runner import Embedder

    extra = dict(kv.split("=", 1) for kv in args.setting)
    embedder, _ = Embedder.load(args.model, device=args.device, dtype=args.dtype, backend=extra.get("backend", "auto"),
                                max_batch_tokens=args.max_batch_tokens, max_batch=args.max_batch)
    ids = embedder.tokenizer.encode(texts)
    batches = _batches(ids, args.max_batch, args.max_batch_tokens)
    for batch in batches:  # warm: one graph capture per bucket
        embedder.embed_ids(batch)
    passes = 3 if on_cuda(args) else 1
    started = time.perf_counter()
    for _ in range(passes):
        for batch in batches:
            embedder.embed_ids(batch)
    rate = passes * sum(map(len, ids)) / (time.perf_counter() - started)
    print(f"runner alone: {rate / 1e6:.3f} M tokens/s over {len(batches)} batches", file=sys.stderr, flush=True)
    del embedder
    _release_device()
    return ids, rate


def sentence_transformers_rate(args: argparse.Namespace, texts: list[str], tokens: int) -> float | None:
    """SentenceTransformer.encode on the same texts (fp16 on a GPU), tokens/s; None for a random-init preset (no
    sentence-transformers checkpoint to load) or with --no-sentence-transformers."""
    from fusedserve.model.config import PRESETS

    if not args.st or args.model in PRESETS:
        return None
    from sentence_transformers import SentenceTransformer

    from fusedserve.model.weights import default_model_dir

    st = SentenceTransformer(str(default_model_dir() if args.model == "default" else args.model), device=args.device)
    if on_cuda(args):
        st = st.half()
    batch_size = 512 if on_cuda(args) else 64
    st.encode(texts[:batch_size], batch_size=batch_size)  # warm
    started = time.perf_counter()
    st.encode(texts, batch_size=batch_size)
    rate = tokens / (time.perf_counter() - started)
    print(f"sentence-transformers encode: {rate / 1e6:.3f} M tokens/s", file=sys.stderr, flush=True)
    del st
    _release_device()
    return rate


def _release_device() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _point(run: dict, inside: dict, raw: float, st_rate: float | None, **labels) -> dict:
    latencies, elapsed = run["latencies"], run["elapsed"]
    served = run["tokens"] / elapsed
    return {**labels, "requests": len(latencies), "errors": run["errors"], "seconds": elapsed,
            "requests_per_s": len(latencies) / elapsed, "tokens_per_s": served, **percentiles_ms(latencies),
            "served_vs_raw": served / raw,
            "vs_sentence_transformers": served / st_rate if st_rate else None, "server": inside}


def _say(label: str, row: dict) -> None:
    s = row["server"]
    print(f"[{label}] {row['clients']} clients: {row['requests_per_s']:.0f} requests/s, "
          f"{row['tokens_per_s'] / 1e6:.3f} M tokens/s ({100 * row['served_vs_raw']:.0f}% of raw), p50 "
          f"{row['p50_ms']:.1f} ms p99 {row['p99_ms']:.1f} ms, {row['errors']} errors; server "
          f"{s['server_request_ms']:.1f} ms/request (queued {s['queue_ms_per_input']:.1f}), "
          f"{s['batches']:.0f} batches of {s['inputs_per_batch']:.0f}, forward {s['forward_ms_per_batch']:.2f} ms, "
          f"CPU {s['cpu_ms_per_request']:.2f} ms/request", file=sys.stderr, flush=True)


@contextlib.contextmanager
def flame_graph(pid: int, seconds: float, path: str | None):
    """With `path`: py-spy records the server process `pid` and its workers for `seconds` into that SVG while the
    block runs (py-spy from $PY_SPY or the PATH; on the GPU machine it comes with the carried wheels)."""
    if not path:
        yield
        return
    exe = os.environ.get("PY_SPY") or shutil.which("py-spy")
    if not exe:
        raise SystemExit("--flame-graph needs py-spy: pip install py-spy, or set PY_SPY to its binary")
    record = subprocess.Popen([exe, "record", "--subprocesses", "--nonblocking", "-r", "200", "-d", str(int(seconds)),
                               "-p", str(pid), "-o", path], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
    try:
        yield
    finally:
        _, err = record.communicate(timeout=seconds + 60)
        print(f"flame graph of the server: {path}" if record.returncode == 0 else
              f"py-spy failed ({record.returncode}): {err.strip()[-300:]}", file=sys.stderr, flush=True)


def closed_loop_scenario(args: argparse.Namespace, save) -> None:
    texts = traffic(args)
    ids, raw = raw_runner(args, texts)
    tokens = list(map(len, ids))
    st_rate = sentence_transformers_rate(args, texts, sum(tokens))
    summary = {"texts": len(texts), "tokens": sum(tokens), "runner_raw_tokens_per_s": raw,
               "sentence_transformers_tokens_per_s": st_rate, "mps": _mps()}
    rows: list[dict] = []
    with running_servers(args.servers, log_path(args, "closed-loop"), **server_settings(args)) as servers:
        urls = [url for _, url in servers]
        summary["kernel_choices"] = kernel_choices(urls)
        summary["info"] = httpx.get(urls[0] + "/info", timeout=30).json()
        for payload in args.payloads:
            sent = ids if payload == "ids" else texts
            load(urls, sent, 64, 3, args.per_request, processes=args.client_processes, payload=payload)  # warm
            for clients in args.clients:
                first = payload == args.payloads[0] and clients == args.clients[0]
                with flame_graph(servers[0][0].pid, args.seconds, args.flame_graph if first else None):
                    run, inside = measured_load(urls, sent, clients, args.seconds, args.per_request, tokens,
                                                args.client_processes, payload)
                rows.append(_point(run, inside, raw, st_rate, servers=args.servers, payload=payload, clients=clients))
                _say(f"{args.servers} server(s), {payload}", rows[-1])
                save(rows, summary, False)
    save(rows, summary, True)


def single_scenario(args: argparse.Namespace, save) -> None:
    one = sentences(1, 20)
    # no sampled kernel timing unless asked: one eagerly timed batch among a few hundred sequential requests would
    # be their p99 and most of their mean
    settings = {"kernel_timing_sample_rate": "0", **server_settings(args)}
    with running_servers(1, log_path(args, "single"), **settings) as servers:
        url = servers[0][1]
        single = single_requests(url, one, args.single_count)
        info = httpx.get(url + "/info", timeout=30).json()
    raw = single["raw_client"]
    rows = [
        {"client": "http.client", "route": "POST /infer", "p50_ms": raw["infer_p50_ms"], "p99_ms": raw["infer_p99_ms"]},
        {"client": "http.client", "route": "GET /healthz", "p50_ms": raw["healthz_p50_ms"],
         "p99_ms": raw["healthz_p99_ms"]},
        {"client": "httpx", "route": "POST /infer", "p50_ms": single["p50_ms"], "p99_ms": single["p99_ms"],
         "mean_ms": single["mean_ms"]},
        {"client": "httpx", "route": "GET /healthz", "p50_ms": single["healthz_p50_ms"]},
    ]
    print(f"one 20-word request: http.client p50 {raw['infer_p50_ms']:.2f} ms (GET /healthz "
          f"{raw['healthz_p50_ms']:.2f}), httpx p50 {single['p50_ms']:.2f} ms; the server's own time "
          f"{single['server']['server_request_ms']:.2f} ms, of which the forward "
          f"{single['server']['forward_ms_per_batch']:.2f}", file=sys.stderr, flush=True)
    save(rows, {"text_words": 20, "requests": args.single_count, "server": single["server"], "info": info}, True)


def first_requests(url: str, texts: list[str]) -> dict:
    """Each text as its own request, one at a time, from the first on (no warm-up): what the first users after
    /readyz see, including any request that pays a compile."""
    latencies = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for text in texts:
            t = time.perf_counter()
            client.post("/infer", json={"inputs": text}).raise_for_status()
            latencies.append(time.perf_counter() - t)
    # the tail, request by request: where in the sequence and how long its text was says what it paid for
    slowest = sorted(range(len(texts)), key=latencies.__getitem__, reverse=True)[:12]
    return {"requests": len(texts), **percentiles_ms(latencies), "max_ms": max(latencies) * 1e3,
            "slowest": [{"index": i, "words": len(texts[i].split()), "ms": round(latencies[i] * 1e3, 2)}
                        for i in sorted(slowest)]}


def _cache_contents(cache: Path) -> dict:
    """What a start left in its cache directory: Triton's compiled kernels (one .cubin per compiled variant) and the
    tuning tables' entries."""
    tables = {}
    for path in cache.glob("*.json"):
        with contextlib.suppress(OSError, ValueError):
            table = json.loads(path.read_text())
            tables[path.name.split("-")[0]] = (sum(map(len, table.values())) if path.name.startswith("triton-")
                                               else len(table))
    return {"compiled_kernels": len(list(cache.glob("triton/**/*.cubin"))), "table_entries": tables}


def startup_scenario(args: argparse.Namespace, save) -> None:
    """Time to ready of a server started on an empty cache directory (cold: what a new pod of the GPU image does,
    its CUDA extension prebuilt) and again on the cache the first start left (warm: a restart, a second replica
    on the node), with the default settings and the suite's batch limits; after the cold start, the first 1,000
    sequential single requests of 5-200 words (does any pay a compile?)."""
    cache = tempfile.mkdtemp(prefix="fusedserve-cache-")
    env = {"cache_dir": cache, **server_settings(args)}
    rows = []
    for start in ("cold", "warm"):
        started = time.monotonic()
        # at info: the log keeps the start-up report, whose phases say where the time to ready went
        with running_servers(1, log_path(args, f"startup-{start}"), log_level="info", **env) as servers:
            row = {"start": start, "ready_s": time.monotonic() - started, **_cache_contents(Path(cache))}
            url = servers[0][1]
            if start == "cold":
                row["first_requests"] = first_requests(url, mixed_texts(args.first_requests, seed=1, low=5,
                                                                        high=200))
        rows.append(row)
        print(f"{start} start: ready in {row['ready_s']:.1f} s ({row['compiled_kernels']} compiled kernels and "
              f"tables {row['table_entries']} in {cache})" + (
            f"; first {row['first_requests']['requests']} single requests p50 {row['first_requests']['p50_ms']:.2f} "
            f"ms, p99 {row['first_requests']['p99_ms']:.2f} ms, max {row['first_requests']['max_ms']:.1f} ms"
            if "first_requests" in row else ""), file=sys.stderr, flush=True)
        save(rows, {"cache_dir": "a fresh temporary directory"}, False)
    save(rows, {"cache_dir": "a fresh temporary directory"}, True)


async def _one_beside_large(url: str, one: str, large: list[str] | None, seconds: float, gap_s: float) -> dict:
    """One client posting `one` to /infer every gap_s for `seconds` (its latencies), and, with `large`, another
    posting `large` back to back meanwhile (its latencies too). aiohttp, one connection each."""
    import aiohttp

    stop = time.monotonic() + seconds
    small_s: list[float] = []
    large_s: list[float] = []
    failed: collections.Counter = collections.Counter()

    async def post(session: aiohttp.ClientSession, texts: list[str], into: list[float]) -> None:
        t = time.perf_counter()
        async with session.post("/infer", json={"inputs": texts}) as r:
            await r.read()
            if r.status == 200:
                into.append(time.perf_counter() - t)
            else:
                failed[str(r.status)] += 1

    async def small() -> None:
        async with one_connection_session(url) as s:
            while time.monotonic() < stop:
                started = time.monotonic()
                await post(s, [one], small_s)
                await asyncio.sleep(max(0.0, gap_s - (time.monotonic() - started)))

    async def big() -> None:
        async with one_connection_session(url) as s:
            while time.monotonic() < stop:
                await post(s, large, large_s)

    await asyncio.gather(small(), *([big()] if large else []))
    return {"small": small_s, "large": large_s, "failed": dict(failed)}


def _spread_ms(latencies: list[float]) -> dict[str, float]:
    """p50, p99 (inclusive: a slow point yields a few dozen samples) and max in ms."""
    return {**percentiles_ms(latencies, method="inclusive"), "max_ms": max(latencies, default=math.nan) * 1e3}


def head_of_line_scenario(args: argparse.Namespace, save) -> None:
    """A one-input request's latency, alone and beside the largest requests the server accepts, at the server's
    default batch limits (a CPU device batches 2048 tokens: the suite's --max-batch-tokens is not passed)."""
    from fusedserve.server.config import Settings

    defaults = Settings.model_fields
    inputs = defaults["max_client_batch"].default
    chars = defaults["max_request_chars"].default // inputs
    words = sentences(4096, 40, seed=3)
    large = [(" ".join(words[i:i + 40]))[:chars] for i in range(inputs)]
    one = sentences(1, 20)[0]
    settings = {k: v for k, v in server_settings(args).items()
                if k not in ("max_batch_tokens", "max_batch_requests", "max_client_batch")}
    rows, summary = [], {"gap_ms": args.gap_ms, "large_inputs": inputs, "large_chars_each": chars}
    with running_servers(1, log_path(args, "head-of-line"), **settings) as servers:
        url = servers[0][1]
        asyncio.run(_one_beside_large(url, one, large[:4], 2.0, args.gap_ms / 1e3))  # warm: compiles, first batches
        for beside in (False, True):
            got = asyncio.run(_one_beside_large(url, one, large if beside else None, args.seconds, args.gap_ms / 1e3))
            row = {"client": "one input", "beside": "the largest requests" if beside else "nothing",
                   "requests": len(got["small"]), **_spread_ms(got["small"]), "failed": got["failed"]}
            rows.append(row)
            if beside:
                rows.append({"client": f"{inputs} inputs of {chars} characters", "beside": "one input",
                             "requests": len(got["large"]), **_spread_ms(got["large"]), "failed": got["failed"]})
            for r in rows[-1 - beside:]:
                print(f"[head-of-line] {r['client']} beside {r['beside']}: {r['requests']} requests, p50 "
                      f"{r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, max {r['max_ms']:.1f} ms",
                      file=sys.stderr, flush=True)
            save(rows, summary, False)
    save(rows, summary, True)


def _mps() -> bool:
    """A CUDA MPS control daemon answers on this process's pipe directory (the servers' contexts then share the GPU
    through it)."""
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")) / "control"
    return pipe.exists()


def _sharing_point(args: argparse.Namespace, urls: list[str], sent: list, tokens: list[int], raw: float,
                   st_rate: float | None, payload: str, **labels) -> dict:
    """`payload` (texts or their token ids) from --replica-clients clients at the servers `urls` (warmed first): one
    point, served tokens/s against the runner's raw rate and sentence-transformers'."""
    load(urls, sent, args.replica_clients, 3, args.per_request, processes=args.client_processes, payload=payload)
    run, inside = measured_load(urls, sent, args.replica_clients, args.seconds, args.per_request, tokens,
                                args.client_processes, payload)
    return _point(run, inside, raw, st_rate, payload=payload, clients=args.replica_clients, **labels)


def _sharing_scenario(args: argparse.Namespace, save, label: str, counts: list[int], start) -> None:
    """One point per count and payload: `start(count)` is a context yielding [(process, url)] of the servers
    sharing the device (several servers, or one with several workers)."""
    texts = traffic(args)
    ids, raw = raw_runner(args, texts)
    tokens = list(map(len, ids))
    st_rate = sentence_transformers_rate(args, texts, sum(tokens))
    summary = {"texts": len(texts), "tokens": sum(tokens), "runner_raw_tokens_per_s": raw,
               "sentence_transformers_tokens_per_s": st_rate, "mps": _mps()}
    rows: list[dict] = []
    for count in counts:
        with start(count) as servers:
            urls = [url for _, url in servers]
            extra = {}
            if len(urls) > 1:  # separate servers race their kernels apart: say where they chose differently
                extra["kernel_choices_differ"] = {op: c for op, c in kernel_choices(urls).items() if len(c) > 1}
            for payload in args.payloads:
                rows.append(_sharing_point(args, urls, ids if payload == "ids" else texts, tokens, raw, st_rate,
                                           payload, **{label: count}, **extra))
                _say(f"{label} {count}, {payload}{' (MPS)' if summary['mps'] else ''}", rows[-1])
                save(rows, summary, False)
    save(rows, summary, True)


def replicas_scenario(args: argparse.Namespace, save) -> None:
    _sharing_scenario(args, save, "replicas", args.replica_counts,
                      lambda n: running_servers(n, log_path(args, f"replicas-{n}"), **server_settings(args)))


def workers_scenario(args: argparse.Namespace, save) -> None:
    """One server with WORKERS=n (n processes on one port, each with its model on the device; under CUDA MPS when
    its daemon runs), one point per n in --worker-counts."""
    _sharing_scenario(args, save, "workers", args.worker_counts,
                      lambda n: running_servers(1, log_path(args, f"workers-{n}"),
                                                **{**server_settings(args), "workers": str(n)}))


def soak_scenario(args: argparse.Namespace, save) -> None:
    import torch

    from bench.load import check, rss_bytes, run_clients, texts_of_mixed_length

    settings = server_settings(args)
    with running_servers(1, log_path(args, "soak"), **settings) as servers:
        process, url = servers[0]
        pool = texts_of_mixed_length(40)
        singles = {t: torch.tensor(httpx.post(url + "/infer", json={"inputs": [t]}, timeout=60).json()["embeddings"][0])
                   for t in pool}
        rss_before = rss_bytes(process.pid)
        started = time.monotonic()
        outcomes, cancelled = asyncio.run(run_clients(url, pool, args.soak_clients, args.seconds, args.cancel_rate))
        elapsed = time.monotonic() - started
        rss_after = rss_bytes(process.pid)
    statuses = collections.Counter(str(r.status_code) for _, r, _ in outcomes)
    latencies = sorted(s for _, r, s in outcomes if r.status_code == 200)
    atol = args.soak_atol if args.soak_atol is not None else (1e-5 if args.dtype in ("float32", "auto") and
                                                              not on_cuda(args) else 2e-3)
    row = {"clients": args.soak_clients, "seconds": elapsed, "cancel_rate": args.cancel_rate,
           "answered": len(outcomes), "cancelled": cancelled, "statuses": dict(statuses),
           "wrong_answers": check(outcomes, singles, atol), "atol": atol,
           "requests_per_s": len(outcomes) / elapsed, **percentiles_ms(latencies),
           "rss_before_mib": rss_before / 2**20, "rss_after_mib": rss_after / 2**20}
    print(f"soak: {row['answered']} answered, {cancelled} cancelled, statuses {dict(statuses)}, "
          f"{row['wrong_answers']} wrong; RSS {row['rss_before_mib']:.0f} -> {row['rss_after_mib']:.0f} MiB",
          file=sys.stderr, flush=True)
    save([row], {}, True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    parser.add_argument("scenarios", nargs="*", metavar="SCENARIO",
                        help=f"any of {', '.join(SCENARIOS)} (default: {' '.join(DEFAULT_SCENARIOS)})")
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--model", default="default",
                        help="the packaged MiniLM (default), a checkpoint directory or a preset (random init)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seconds", type=float, default=6.0 if cuda else 10.0, help="measured seconds per point")
    parser.add_argument("--clients", type=int, nargs="+", default=[16, 64, 256] if cuda else [32],
                        help="closed-loop: concurrent clients, one point each")
    parser.add_argument("--payloads", nargs="+", choices=("text", "ids"), default=["text", "ids"])
    parser.add_argument("--per-request", type=int, default=16 if cuda else 1, help="inputs per request")
    parser.add_argument("--servers", type=int, default=1, help="closed-loop: servers sharing the device")
    parser.add_argument("--replica-counts", type=int, nargs="+", default=[4, 6],
                        help="replicas: servers sharing the device, one point each")
    parser.add_argument("--worker-counts", type=int, nargs="+", default=[2, 4, 6],
                        help="workers: WORKERS of the one server, one point each")
    parser.add_argument("--replica-clients", type=int, default=64, help="workers, replicas: concurrent clients")
    parser.add_argument("--texts", type=int, default=4096 if cuda else 512, help="the traffic: this many texts")
    parser.add_argument("--max-words", type=int, default=200 if cuda else 40,
                        help="the traffic: 1 to this many words per text")
    parser.add_argument("--client-processes", type=int, default=8 if cuda else 1,
                        help="load-generator processes (one Python process cannot drive hundreds of connections "
                             "against a fast server without becoming the bottleneck)")
    parser.add_argument("--max-batch", type=int, default=256, help="the servers' max_batch_requests")
    parser.add_argument("--max-batch-tokens", type=int, default=16384, help="the servers' max_batch_tokens")
    parser.add_argument("--max-wait-ms", type=float, default=0.0, help="the servers' max_wait_ms")
    parser.add_argument("--timing-rate", type=float,
                        help="the servers' kernel_timing_sample_rate (default: the server's; single: 0)")
    parser.add_argument("--verify-rate", type=float, help="the servers' verify_sample_rate (default: the server's)")
    parser.add_argument("--setting", action="append", default=[], metavar="KEY=VALUE",
                        help="another server setting (FUSEDSERVE_KEY without the prefix), e.g. backend=triton")
    parser.add_argument("--no-sentence-transformers", dest="st", action="store_false",
                        help="closed-loop: skip sentence-transformers' encode on the same texts")
    parser.add_argument("--single-count", type=int, default=200, help="single: requests per client")
    parser.add_argument("--first-requests", type=int, default=1000,
                        help="startup: sequential single requests timed after the cold start")
    parser.add_argument("--soak-clients", type=int, default=200)
    parser.add_argument("--gap-ms", type=float, default=50.0,
                        help="head-of-line: the one-input client's pause between requests")
    parser.add_argument("--cancel-rate", type=float, default=0.1, help="soak: share of requests given up early")
    parser.add_argument("--soak-atol", type=float,
                        help="soak: largest element difference from the single-request embedding that counts as "
                             "right (default 1e-5 in fp32 on the CPU, 2e-3 otherwise)")
    parser.add_argument("--log-dir", help="write each scenario's server log here")
    parser.add_argument("--flame-graph", metavar="SVG",
                        help="closed-loop: a py-spy flame graph of the server (and its workers) during the first "
                             "measured point, written here")
    parser.add_argument("--out", help="the results file (default: bench/results/<gpu>/serve.json)")
    parser.add_argument("--as", dest="block_name", metavar="NAME",
                        help="save the one scenario run under this name instead of its own (another model's "
                             "start-up beside the default model's: startup-modernbert-base)")
    peer.add_arguments(parser)
    openai_load.add_arguments(parser)
    devices_load.add_arguments(parser)
    frontends_load.add_arguments(parser)
    m3_load.add_arguments(parser)
    cpu_peers.add_arguments(parser)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    # a time limit's SIGTERM unwinds like an exception, so running_servers stops the servers it started (a killed
    # harness would otherwise leave a server shutting down on the GPU beside the next step)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    import torch

    out = args.out or store.default_path("serve", args.device)
    gpu = store.gpu_slug(torch.cuda.get_device_name(torch.device(args.device)) if on_cuda(args) else None)
    scenarios = {"closed-loop": closed_loop_scenario, "single": single_scenario, "workers": workers_scenario,
                 "peer": peer.peer_scenario, "openai-load": openai_load.openai_load_scenario,
                 "devices": devices_load.devices_scenario,
                 "replicas": replicas_scenario, "soak": soak_scenario, "startup": startup_scenario,
                 "head-of-line": head_of_line_scenario, "cpu": cpu_peers.cpu_scenario,
                 "frontends": frontends_load.frontends_scenario, "m3": m3_load.m3_scenario}
    if args.block_name and len(args.scenarios or DEFAULT_SCENARIOS) != 1:
        raise SystemExit("--as names one scenario's block: run one scenario with it")
    started = time.monotonic()
    for scenario in args.scenarios or DEFAULT_SCENARIOS:
        head = store.header(args.device, argv)
        settings = {"device": args.device, "server": server_settings(args), "seconds": args.seconds,
                    "per_request": args.per_request, "client_processes": args.client_processes,
                    "texts": args.texts, "max_words": args.max_words}
        settings.update({"closed-loop": {"servers": args.servers, "clients": args.clients, "payloads": args.payloads},
                         "single": {"requests": args.single_count},
                         "workers": {"worker_counts": args.worker_counts, "clients": args.replica_clients,
                                     "payloads": args.payloads},
                         "replicas": {"replica_counts": args.replica_counts, "clients": args.replica_clients,
                                      "payloads": args.payloads},
                         "soak": {"clients": args.soak_clients, "cancel_rate": args.cancel_rate},
                         "peer": peer.settings(args), "openai-load": openai_load.settings(args),
                         "devices": devices_load.settings(args), "frontends": frontends_load.settings(args),
                         "m3": m3_load.settings(args),
                         "startup": {"first_requests": args.first_requests},
                         "head-of-line": {"gap_ms": args.gap_ms},
                         "cpu": cpu_peers.settings(args)}[
            scenario])
        if scenario in ("openai-load", "devices", "frontends", "m3"):  # their points say how many texts a request carries
            del settings["per_request"]

        def save(rows: list[dict], summary: dict, complete: bool, scenario: str = scenario, head: dict = head,
                 settings: dict = settings) -> None:
            store.write(out, "serve", gpu, args.block_name or scenario,
                        store.block(head, settings, rows, summary, complete=complete))

        scenarios[scenario](args, save)
        print(f"{args.block_name or scenario}: {out} ({time.monotonic() - started:.0f} s into the run)", file=sys.stderr, flush=True)
    return 0
