"""Serving benchmark: the real server under closed-loop load (N concurrent clients, each sending its next
request when the last one is answered) against sentence-transformers' own batched encode on the same
sentences, in the same run.

    python -m bench.serve --clients 32 --seconds 20 --out bench/results/$(date +%F)-cpu-serve.json

Reports requests/s, sentences/s, tokens/s, p50/p99 latency, and ST's sentences/s at batch_size 64.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import http.client
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx

from bench import command, save

WORDS = ("the of and to in is was for on that with as by at from his an were are which this be or had not but "
         "one all their there been has more when who will would into them its some could time these two may "
         "first then do any like my now over such our man me even most made after also did many off before "
         "must through back years where much your way well down should because each just those people how too "
         "little state good very make world still own see men work long get here between both life being under "
         "never day same another know while last might us great old year come since against go came right used "
         "take three kernel fused batch token encoder layer norm embedding vector server request latency").split()


def sentences(n: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "." for _ in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_servers(count: int, log_path: str = os.devnull, *, command: list[str] | None = None, **settings: str):
    """`count` x `python -m server` (or `command`, which takes the same --port/--log-level arguments) on free loopback
    ports with FUSEDSERVE_* settings, started together (replicas on one machine, as a Kubernetes node runs several
    pods), all writing to `log_path`. Yields [(process, url)] once every one is ready."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{f"FUSEDSERVE_{k.upper()}": v for k, v in settings.items()})
    command = command or [sys.executable, "-m", "server"]
    servers, log = [], open(log_path, "a")
    try:
        for _ in range(count):
            port = free_port()
            process = subprocess.Popen([*command, "--port", str(port), "--log-level", "warning"], env=env, stdout=log,
                                       stderr=subprocess.STDOUT)
            servers.append((process, f"http://127.0.0.1:{port}"))
        deadline = time.monotonic() + 300
        for process, url in servers:
            while True:
                try:
                    if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("server did not become ready")
                time.sleep(0.3)
        yield servers
    finally:
        for process, _ in servers:
            process.terminate()
        for process, _ in servers:
            process.wait(timeout=60)
        log.close()


@contextlib.contextmanager
def running_server(**settings: str):
    """One `python -m server` (see running_servers); yields (process, url) once ready."""
    with running_servers(1, **settings) as servers:
        yield servers[0]


def kernel_choices(urls: list[str]) -> dict[str, dict[str, int]]:
    """Per op, how many of the servers chose each backend (their /info): replicas starting together on one GPU race
    their kernels beside each other's start-up work, so they may choose differently."""
    counts: dict[str, collections.Counter] = {}
    for url in urls:
        for op, choice in httpx.get(url + "/info").json()["kernels"].items():
            counts.setdefault(op, collections.Counter())[choice["backend"]] += 1
    return {op: dict(c) for op, c in counts.items()}


def sentence_transformers_rate(texts: list[str], batch_size: int, device: str) -> float:
    from sentence_transformers import SentenceTransformer

    from model.weights import default_model_dir

    st = SentenceTransformer(str(default_model_dir()), device=device)
    st.encode(texts[:batch_size], batch_size=batch_size)  # warm-up
    started = time.perf_counter()
    st.encode(texts, batch_size=batch_size)
    return len(texts) / (time.perf_counter() - started)


def request_body(payload: str, rows: list) -> tuple[str, dict]:
    """The route and JSON body of one request: "text" sends texts to /infer; "ids" sends token ids to the
    OpenAI route with base64 vectors (what a client that tokenizes itself sends: no tokenizer on the server)."""
    if payload == "ids":
        return "/v1/embeddings", {"input": rows, "encoding_format": "base64"}
    return "/infer", {"inputs": rows}


async def closed_loop(urls: str | list[str], texts: list, clients: int, seconds: float, per_request: int,
                      count_tokens: list[int] | None = None, seed: int = 1, payload: str = "text") -> dict:
    """`clients` connections, each sending its next request when the last is answered, for `seconds`. Every
    client has its own connection (one httpx client each: a shared pool costs the load generator time that grows
    with the number of connections); with several servers (replicas) the clients are spread over them in turn,
    as a Kubernetes Service spreads connections. `texts` are strings, or token-id lists for payload "ids";
    `count_tokens[i]` is the token count of `texts[i]`."""
    urls = [urls] if isinstance(urls, str) else urls
    latencies: list[float] = []
    errors = sent = 0
    stop = time.monotonic() + seconds
    rng = random.Random(seed)

    async def client_loop(url: str) -> None:
        nonlocal errors, sent
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=1)) as client:
            while time.monotonic() < stop:
                picked = [rng.randrange(len(texts)) for _ in range(per_request)]
                route, body = request_body(payload, [texts[i] for i in picked])
                t = time.perf_counter()
                try:
                    r = await client.post(route, json=body)
                except httpx.HTTPError as exc:  # counted, and the run goes on: the report says how many
                    errors += 1
                    print(f"client error: {type(exc).__name__}: {exc}", file=sys.stderr)
                    await asyncio.sleep(0.1)
                    continue
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - t)
                    if count_tokens is not None:
                        sent += sum(count_tokens[i] for i in picked)
                else:
                    errors += 1

    started = time.monotonic()
    await asyncio.gather(*(client_loop(urls[(seed + i) % len(urls)]) for i in range(clients)))
    return {"latencies": latencies, "errors": errors, "elapsed": time.monotonic() - started, "tokens": sent}


def _load_process(job: tuple) -> dict:
    start_at, args = job[0], job[1:]
    time.sleep(max(start_at - time.time(), 0))
    return asyncio.run(closed_loop(*args))


def load(urls: str | list[str], texts: list, clients: int, seconds: float, per_request: int,
         count_tokens: list[int] | None = None, processes: int = 1, payload: str = "text") -> dict:
    """closed_loop, spread over `processes` load-generator processes that start together (one Python process
    cannot drive hundreds of connections against a fast server without becoming the bottleneck itself)."""
    processes = max(1, min(processes, clients))
    if processes == 1:
        return asyncio.run(closed_loop(urls, texts, clients, seconds, per_request, count_tokens, 1, payload))
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    shares = [clients // processes + (i < clients % processes) for i in range(processes)]
    start_at = time.time() + 3.0  # the workers' interpreters start first
    jobs = [(start_at, urls, texts, n, seconds, per_request, count_tokens, i + 1, payload)
            for i, n in enumerate(shares)]
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        parts = list(pool.map(_load_process, jobs))
    return {"latencies": [x for p in parts for x in p["latencies"]], "errors": sum(p["errors"] for p in parts),
            "elapsed": max(p["elapsed"] for p in parts), "tokens": sum(p["tokens"] for p in parts)}


SERVER_SUMS = {
    "request": "fusedserve_request_duration_seconds_sum{{route=\"{route}\"}}",
    "requests": "fusedserve_request_duration_seconds_count{{route=\"{route}\"}}",
    "queue": "fusedserve_queue_duration_seconds_sum", "inputs": "fusedserve_queue_duration_seconds_count",
    "batch_size": "fusedserve_batch_size_sum", "batches": "fusedserve_batch_size_count",
    "cpu": "process_cpu_seconds_total",  # the server process's user + system CPU time (prometheus_client)
}


def measured_load(urls: str | list[str], rows: list, clients: int, seconds: float, per_request: int,
                  count_tokens: list[int], processes: int = 1, payload: str = "text") -> tuple[dict, dict]:
    """One closed-loop run (load) and the servers' own account of it (server_breakdown of their /metrics before and
    after, on the payload's route): (run, inside)."""
    route = request_body(payload, [])[0]
    before = server_sums(urls, route)
    run = load(urls, rows, clients, seconds, per_request, count_tokens, processes, payload)
    return run, server_breakdown(before, settled_sums(urls, route), run["elapsed"])


def server_sums(urls: str | list[str], route: str = "/infer") -> dict[str, float]:
    """Counters and histogram sums of the servers' /metrics that the per-run breakdown is built from (summed over
    replicas)."""
    totals: collections.Counter = collections.Counter()
    for url in [urls] if isinstance(urls, str) else urls:
        values: dict[str, float] = {}
        for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        totals.update({k: values.get(v.format(route=route), 0.0) for k, v in SERVER_SUMS.items()})
        totals["forward"] += sum(v for k, v in values.items()
                                 if k.startswith("fusedserve_forward_duration_seconds_sum"))
    return dict(totals)


def settled_sums(urls: str | list[str], route: str = "/infer", tries: int = 20) -> dict[str, float]:
    """server_sums once two reads 50 ms apart agree: the server records a request's duration just after sending
    its response, so a read taken the moment the clients have their last answers can miss the last few."""
    last = server_sums(urls, route)
    for _ in range(tries):
        time.sleep(0.05)
        current = server_sums(urls, route)
        if current == last:
            break
        last = current
    return last


def server_breakdown(before: dict[str, float], after: dict[str, float], elapsed: float) -> dict[str, float]:
    """Where a request's time went inside the server during one run: mean time from arrival to response, of which
    queued (waiting for a batch), and the model's forward time per batch; the rest is the server's own work
    (parsing, tokenizing, batching, serializing) plus waiting on the worker."""
    d = {k: after[k] - before[k] for k in after}
    requests, batches = max(d["requests"], 1), max(d["batches"], 1)
    out = {"requests": d["requests"], "server_request_ms": 1e3 * d["request"] / requests,
           "queue_ms_per_input": 1e3 * d["queue"] / max(d["inputs"], 1),
           "forward_ms_per_batch": 1e3 * d["forward"] / batches, "batches": d["batches"],
           "inputs_per_batch": d["batch_size"] / batches,
           "forward_busy": d["forward"] / elapsed,  # summed over replicas
           # CPU the server process(es) spent per request, all threads (event loop, batcher, tokenizer): what caps
           # a GIL-bound process at 1000 / cpu_ms_per_request requests/s; cpu_cores is summed over replicas
           "cpu_ms_per_request": 1e3 * d["cpu"] / requests, "cpu_cores": d["cpu"] / elapsed}
    # the server's own time per request: in the server, but neither queued for a batch nor in a forward (parsing,
    # validation, tokenizing, the thread hops, waiting for the event loop, serializing)
    out["overhead_ms"] = out["server_request_ms"] - out["queue_ms_per_input"] - out["forward_ms_per_batch"]
    return out


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
    q = statistics.quantiles(latencies, n=100)
    raw = raw_client_latency(url, texts, count)
    return {"requests": count, "p50_ms": q[49] * 1e3, "p99_ms": q[98] * 1e3,
            "mean_ms": statistics.fmean(latencies) * 1e3, "server": inside,
            "healthz_p50_ms": statistics.median(floor) * 1e3, "raw_client": raw}


def raw_client_latency(url: str, texts: list[str], count: int = 200, warm: int = 20) -> dict:
    """The same requests from the standard library's http.client on one keep-alive connection: a client whose own
    cost per request is ~0.1 ms where httpx's is ~0.5 ms (development CPU), so the server's latency shows through.
    The server's mean (server_*) above is over the httpx requests and includes the 1% of requests that take the
    kernel-timed eager path."""
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
        q = statistics.quantiles(latencies[warm:], n=100)
        out[f"{name}_p50_ms"], out[f"{name}_p99_ms"] = q[49] * 1e3, q[98] * 1e3
    connection.close()
    return out


def mixed_texts(n: int, seed: int = 0, low: int = 1, high: int = 200) -> list[str]:
    """Texts of 1-200 words (uniform), the GPU traffic mix."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))) + "." for _ in range(n)]


def gpu_sweep(args, argv: list[str] | None = None) -> dict:
    """The H200 serving run: raw runner tokens/s on the traffic mix, sentence-transformers fp16 encode on the same
    texts, then the real server under closed-loop load at each client count, and single-request latency."""
    from model.runner import Embedder

    if args.single_only:
        return single_only(args, argv)
    texts = mixed_texts(4096)
    settings = gpu_server_settings(args)
    embedder, _ = Embedder.load(args.model, device="cuda", dtype="float16", max_batch_tokens=16384,
                                   max_batch=args.max_batch)
    ids = embedder.tokenizer.encode(texts)
    tokens_total = sum(map(len, ids))
    # raw runner: the same texts in length-sorted batches under the server's limits (what its batcher forms:
    # packed batches are budgeted by their real tokens)
    batches, current, tokens = [], [], 0
    for row in sorted(ids, key=len):
        if current and (len(current) >= args.max_batch or tokens + len(row) > 16384):
            batches.append(current)
            current, tokens = [], 0
        current.append(row)
        tokens += len(row)
    batches.append(current)
    for b in batches:
        embedder.embed_ids(b)  # warm: graph capture per bucket
    started = time.perf_counter()
    for _ in range(3):
        for b in batches:
            embedder.embed_ids(b)
    raw = 3 * tokens_total / (time.perf_counter() - started)
    print(f"runner raw: {raw / 1e6:.2f} M tokens/s over {len(batches)} batches", file=sys.stderr, flush=True)
    del embedder
    torch_cuda_empty()

    one = sentences(1, 20)
    st_rate, st_lat = sentence_transformers_gpu(args.model, texts, tokens_total, one) if args.st else (None, [])

    runs, single, info, metrics = [], {}, {}, ""
    token_count = list(map(len, ids))

    def report() -> dict:  # saved after every run too: a sweep cut short by a time limit keeps what it measured
        return {
            "date": time.strftime("%Y-%m-%d"), "device": "cuda", "settings": settings, "per_request": args.per_request,
            "client_processes": args.client_processes,
            "texts": len(texts), "tokens": tokens_total, "runner_raw_tokens_per_s": raw,
            "sentence_transformers_fp16_tokens_per_s": st_rate,
            "sentence_transformers_single_p50_ms": statistics.median(st_lat) * 1e3 if st_lat else None,
            "single_request": single or None,  # earlier reports: single_request_p50_ms / _p99_ms
            "runs": runs, "info": info,
            "metrics_excerpt": [line for line in metrics.splitlines()
                                if line.startswith(("fusedserve_kernel_duration_seconds_count",
                                                    "fusedserve_reference_checks_total", "fusedserve_device_memory",
                                                    "fusedserve_batch_size_sum", "fusedserve_batch_size_count"))],
            "command": command("serve", argv),
        }

    for n, config in enumerate(args.configs):
        replicas, extra = parse_config(config)
        log_path = f"{os.path.splitext(args.out)[0]}-server{n}.log" if args.out else os.devnull
        with running_servers(replicas, log_path, **(settings | extra)) as servers:
            urls = [url for _, url in servers]
            choices = kernel_choices(urls)
            split = [f"{op} " + ", ".join(f"{backend} x{count}" for backend, count in counts.items())
                     for op, counts in choices.items() if len(counts) > 1]
            agreement = "replicas differ on " + "; ".join(split) if split else "the same in every replica"
            print(f"[{config}] kernel choices: {agreement}", file=sys.stderr, flush=True)
            for payload in args.payloads:
                rows = ids if payload == "ids" else texts
                load(urls, rows, 64, 3, args.per_request, processes=args.client_processes, payload=payload)  # warm
                for clients in args.client_counts:
                    run, inside = measured_load(urls, rows, clients, args.seconds, args.per_request, token_count,
                                                args.client_processes, payload)
                    latencies, errors, elapsed, sent = run["latencies"], run["errors"], run["elapsed"], run["tokens"]
                    q = statistics.quantiles(latencies, n=100) if len(latencies) >= 2 else [float("nan")] * 99
                    runs.append({"config": config, "replicas": replicas, "payload": payload, "clients": clients,
                                 "requests": len(latencies), "errors": errors,
                                 "requests_per_s": len(latencies) / elapsed, "tokens_per_s": sent / elapsed,
                                 "p50_ms": q[49] * 1e3, "p99_ms": q[98] * 1e3, "served_vs_raw": sent / elapsed / raw,
                                 "vs_sentence_transformers": sent / elapsed / st_rate if st_rate else None,
                                 "server": inside, "kernel_choices": choices})
                    print(f"[{config} {payload}] {clients} clients: {runs[-1]['requests_per_s']:.0f} req/s, "
                          f"{sent / elapsed / 1e6:.2f} M tok/s ({100 * sent / elapsed / raw:.0f}% of raw), p50 "
                          f"{q[49] * 1e3:.1f} ms p99 {q[98] * 1e3:.1f} ms, {errors} errors; server: "
                          f"{inside['server_request_ms']:.1f} ms/request (queued {inside['queue_ms_per_input']:.1f}, "
                          f"overhead {inside['overhead_ms']:.1f}), "
                          f"{inside['batches']:.0f} batches of {inside['inputs_per_batch']:.0f} inputs, forward "
                          f"{inside['forward_ms_per_batch']:.2f} ms/batch, GPU worker(s) busy "
                          f"{100 * inside['forward_busy']:.0f}%, server CPU {inside['cpu_ms_per_request']:.2f} "
                          f"ms/request ({inside['cpu_cores']:.2f} cores)", file=sys.stderr, flush=True)
                    save(report(), args.out)
            if not single:  # single-request latency on the first configuration
                single = single_requests(urls[0], one)
                info = httpx.get(urls[0] + "/info").json()
                metrics = httpx.get(urls[0] + "/metrics").text
                save(report(), args.out)  # before the next configuration's start-up, which a time limit may cut
    if single:
        inside = single["server"]
        print(f"single 20-word request: p50 {single['p50_ms']:.2f} ms (server {inside['server_request_ms']:.2f} of it, "
              f"forward {inside['forward_ms_per_batch']:.2f}; GET /healthz p50 {single['healthz_p50_ms']:.2f})",
              file=sys.stderr)
    return report()


def gpu_server_settings(args) -> dict[str, str]:
    """The GPU sweep's server settings (FUSEDSERVE_* without the prefix)."""
    return {"model": args.model, "device": "cuda", "dtype": "float16", "max_batch_requests": str(args.max_batch),
            "max_batch_tokens": "16384", "max_wait_ms": str(args.max_wait_ms), "max_queue": "65536",
            "max_client_batch": "256", "kernel_timing_sample_rate": str(args.timing_rate),
            "verify_sample_rate": str(args.verify_rate)}


def parse_config(config: str) -> tuple[int, dict[str, str]]:
    """'replicas=N[,setting=value...]' -> (N, {setting: value})."""
    extra = dict(kv.split("=", 1) for kv in config.split(",") if kv)
    return int(extra.pop("replicas", 1)), extra


def single_only(args, argv: list[str] | None) -> dict:
    """Only the single-request latency on the first configuration (no raw runner, sentence-transformers or load)."""
    settings = gpu_server_settings(args)
    _, extra = parse_config(args.configs[0])
    log_path = f"{os.path.splitext(args.out)[0]}-server.log" if args.out else os.devnull
    with running_servers(1, log_path, **(settings | extra)) as servers:
        url = servers[0][1]
        single = single_requests(url, sentences(1, 20))
        info = httpx.get(url + "/info").json()
    raw = single["raw_client"]
    print(f"single 20-word request: httpx p50 {single['p50_ms']:.2f} ms (GET /healthz {single['healthz_p50_ms']:.2f}); "
          f"http.client p50 {raw['infer_p50_ms']:.2f} ms (GET /healthz {raw['healthz_p50_ms']:.2f})", file=sys.stderr)
    return {"date": time.strftime("%Y-%m-%d"), "device": "cuda", "settings": settings | extra,
            "single_request": single, "info": info, "command": command("serve", argv)}


def sentence_transformers_gpu(model: str, texts: list[str], tokens_total: int,
                              one: list[str]) -> tuple[float | None, list[float]]:
    """SentenceTransformer.encode in fp16 on the same texts (tokens/s) and on one sentence (seconds per call);
    (None, []) for a preset (random weights: there is no sentence-transformers checkpoint to load)."""
    from model.config import PRESETS

    if model in PRESETS:
        print(f"sentence-transformers: skipped ({model} is a random-init preset)", file=sys.stderr, flush=True)
        return None, []
    from sentence_transformers import SentenceTransformer

    from model.weights import default_model_dir

    st = SentenceTransformer(str(default_model_dir() if model == "default" else model), device="cuda").half()
    st.encode(texts[:512], batch_size=512)
    started = time.perf_counter()
    st.encode(texts, batch_size=512)
    rate = tokens_total / (time.perf_counter() - started)
    st.encode(one)
    latencies = []
    for _ in range(50):
        t = time.perf_counter()
        st.encode(one)
        latencies.append(time.perf_counter() - t)
    print(f"sentence-transformers fp16: {rate / 1e6:.3f} M tokens/s; single p50 "
          f"{statistics.median(latencies) * 1e3:.2f} ms", file=sys.stderr, flush=True)
    del st
    torch_cuda_empty()
    return rate, latencies


def torch_cuda_empty() -> None:
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    # a time limit's SIGTERM unwinds like an exception, so running_servers stops the servers it started (session 7:
    # a `timeout` that killed this process left its server shutting down on the GPU beside the next step)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    parser = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--words", type=int, default=20)
    parser.add_argument("--per-request", type=int, default=1, help="sentences per request")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--st-sentences", type=int, default=1024)
    parser.add_argument("--out")
    parser.add_argument("--client-processes", type=int, default=None,
                        help="load-generator processes (default: 1 on CPU, where they would take the server's cores; "
                             "8 for the GPU sweep)")
    parser.add_argument("--torch-threads", type=int, default=0, help="the server's intra-op threads (0: default)")
    parser.add_argument("--client-counts", type=int, nargs="+", default=[16, 64, 256],
                        help="GPU sweep (--device cuda): closed-loop client counts")
    parser.add_argument("--model", default="default", help="GPU sweep: model dir (default: the packaged MiniLM)")
    parser.add_argument("--max-batch", type=int, default=256, help="GPU sweep: max_batch_requests")
    parser.add_argument("--max-wait-ms", type=float, default=0.0,
                        help="GPU sweep: max_wait_ms (0, the default: a batch closes as soon as the worker is free)")
    parser.add_argument("--timing-rate", type=float, default=0.01, help="GPU sweep: kernel_timing_sample_rate")
    parser.add_argument("--verify-rate", type=float, default=0.0, help="GPU sweep: verify_sample_rate")
    parser.add_argument("--payloads", nargs="+", choices=("text", "ids"), default=["text"],
                        help="GPU sweep: texts to /infer (tokenized by the server) and/or token ids to /v1/embeddings")
    parser.add_argument("--no-sentence-transformers", dest="st", action="store_false",
                        help="GPU sweep: skip the sentence-transformers comparison (its rate is then null)")
    parser.add_argument("--single-only", action="store_true",
                        help="GPU sweep: only the single-request latency on the first configuration")
    parser.add_argument("--configs", nargs="+", default=["replicas=1"],
                        help="GPU sweep: server configurations, each 'replicas=N[,setting=value...]' (N servers on "
                             "the one GPU, clients spread over them; settings as FUSEDSERVE_* without the prefix)")
    args = parser.parse_args(argv)
    if args.client_processes is None:
        args.client_processes = 8 if args.device == "cuda" else 1
    if args.device == "cuda":
        report = gpu_sweep(args, argv)
        save(report, args.out)
        print(json.dumps({k: v for k, v in report.items() if k not in ("info", "metrics_excerpt")}, indent=1))
        return 0
    texts = sentences(2048, args.words)

    st_rate = sentence_transformers_rate(texts[: args.st_sentences], 64, args.device)
    print(f"sentence-transformers encode(batch_size=64): {st_rate:.1f} sentences/s", file=sys.stderr)

    extra = {"torch_threads": str(args.torch_threads)} if args.torch_threads else {}
    with running_server(device=args.device, **extra) as (_, url):
        tokens_per_sentence = httpx.post(url + "/infer", json={"inputs": texts[:64]}).json()["usage"]["tokens"] / 64
        run = load(url, texts, args.clients, args.seconds, args.per_request, processes=args.client_processes)
        latencies, errors, elapsed = run["latencies"], run["errors"], run["elapsed"]
        metrics = httpx.get(url + "/metrics").text
    n = len(latencies)
    q = statistics.quantiles(latencies, n=100) if n >= 2 else [float("nan")] * 99
    served = n * args.per_request / elapsed
    batch = [line for line in metrics.splitlines()
             if line.startswith(("fusedserve_batch_size_", "fusedserve_forward_duration_seconds_sum"))]
    report = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "device": args.device, "clients": args.clients, "seconds": elapsed, "words": args.words,
        "per_request": args.per_request, "torch_threads": args.torch_threads,
        "client_processes": args.client_processes, "requests": n, "errors": errors,
        "requests_per_s": n / elapsed, "sentences_per_s": served, "tokens_per_s": served * tokens_per_sentence,
        "p50_ms": q[49] * 1e3, "p99_ms": q[98] * 1e3,
        "sentence_transformers_sentences_per_s": st_rate, "ratio_vs_sentence_transformers": served / st_rate,
        "batch_size_metrics": batch,
        "command": command("serve", argv),
    }
    save(report, args.out)
    print(json.dumps({k: v for k, v in report.items() if k != "batch_size_metrics"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
