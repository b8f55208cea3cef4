"""What the serving scenarios share (bench/serve.py, bench/peer.py, bench/openai_load.py): the traffic corpus, real
servers on loopback ports (this tree's, or an older exported tree's), closed-loop load from client processes and the
latency percentiles. It imports none of the scenario modules, so each of them can import it."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import math
import multiprocessing
import os
import queue
import tempfile
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path

import httpx

WORDS = ("the of and to in is was for on that with as by at from his an were are which this be or had not but "
         "one all their there been has more when who will would into them its some could time these two may "
         "first then do any like my now over such our man me even most made after also did many off before "
         "must through back years where much your way well down should because each just those people how too "
         "little state good very make world still own see men work long get here between both life being under "
         "never day same another know while last might us great old year come since against go came right used "
         "take three kernel fused batch token encoder layer norm embedding vector server request latency").split()


# ---- the corpus -------------------------------------------------------------------------------------------------
def sentences(n: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "." for _ in range(n)]


def mixed_texts(n: int, seed: int = 0, low: int = 1, high: int = 200) -> list[str]:
    """Texts of `low` to `high` words (uniform), the GPU traffic mix."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))) + "." for _ in range(n)]


def traffic(args: argparse.Namespace, low: int = 1) -> list[str]:
    """The suite's corpus: --texts texts of `low` (at most --max-words) to --max-words words."""
    return mixed_texts(args.texts, low=min(low, args.max_words), high=args.max_words)


def percentiles_ms(latencies: list[float], method: str = "exclusive") -> dict[str, float]:
    """p50 and p99 of latencies in seconds, in ms (statistics.quantiles' `method`: "inclusive" stays within the
    samples, where the exclusive one extrapolates past the largest of the few dozen a slow point yields); NaN for
    fewer than two samples."""
    if len(latencies) < 2:
        return {"p50_ms": math.nan, "p99_ms": math.nan}
    q = statistics.quantiles(latencies, n=100, method=method)
    return {"p50_ms": q[49] * 1e3, "p99_ms": q[98] * 1e3}


def one_connection_session(url: str):
    """An aiohttp session of one connection, the load generators' client: httpx costs a client several times
    aiohttp's CPU per request, which on a shared host leaks into the latencies measured."""
    import aiohttp

    return aiohttp.ClientSession(base_url=url, connector=aiohttp.TCPConnector(limit=1),
                                 timeout=aiohttp.ClientTimeout(total=120))


# Two servers said to serve the same model (another system beside ours, an older tree beside this one) must give the
# same texts vectors at least this close: enough to tell another model or another weight file at once, and loose
# enough for two implementations' rounding in any serving dtype.
SAME_MODEL_MIN_COSINE = 0.999


def min_cosine(a: list[list[float]], b: list[list[float]]) -> float:
    """The lowest cosine similarity of a row of `a` with the same row of `b` (float64)."""
    import torch

    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float(torch.nn.functional.cosine_similarity(x, y, dim=1).min())


# ---- the suite's arguments --------------------------------------------------------------------------------------
def on_cuda(args: argparse.Namespace) -> bool:
    return args.device.startswith("cuda")


def server_settings(args: argparse.Namespace) -> dict[str, str]:
    """The servers' FUSEDSERVE_* settings (without the prefix): the suite's batch limits, then --setting extras."""
    settings = {"model": args.model, "device": args.device, "dtype": args.dtype,
                "max_batch_requests": str(args.max_batch), "max_batch_tokens": str(args.max_batch_tokens),
                "max_wait_ms": str(args.max_wait_ms), "max_queue": "65536", "max_client_batch": "256"}
    for key, value in (("kernel_timing_sample_rate", args.timing_rate), ("verify_sample_rate", args.verify_rate)):
        if value is not None:
            settings[key] = str(value)
    settings.update(extra_settings(args))
    return settings


def extra_settings(args: argparse.Namespace) -> dict[str, str]:
    """The --setting KEY=VALUE pairs."""
    return dict(kv.split("=", 1) for kv in args.setting)


def log_path(args: argparse.Namespace, name: str) -> str:
    """Where the servers of scenario part `name` write their log: --log-dir/serve-<name>.log, else nowhere."""
    if not args.log_dir:
        return os.devnull
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    return str(Path(args.log_dir) / f"serve-{name}.log")


def kept_log(args: argparse.Namespace, name: str) -> str:
    """log_path, or without --log-dir a temporary file: a process whose log tail goes into its start-up error."""
    path = log_path(args, name)
    if path == os.devnull:
        handle, path = tempfile.mkstemp(prefix=f"fusedserve-{name}-", suffix=".log")
        os.close(handle)
    return path


# ---- servers ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ServerLaunch:
    """How a server process starts: the command before its --port/--log-level arguments, the directory it runs in,
    and a folder put first on its PYTHONPATH (an older tree's installed fusedserve runs from there)."""

    argv: tuple[str, ...]
    cwd: str | None = None
    path_first: str | None = None

    def env(self, base: dict[str, str]) -> dict[str, str]:
        if self.path_first is None:
            return base
        return {**base, "PYTHONPATH": os.pathsep.join(p for p in (self.path_first, base.get("PYTHONPATH")) if p)}


# this tree, installed as `fusedserve` (editable here; from the wheel on the GPU machine)
CURRENT = ServerLaunch((sys.executable, "-m", "fusedserve", "serve"))


def tree_launch(root: str | Path) -> ServerLaunch:
    """The server of an older tree exported by `python -m bench.gpu_assets --baseline COMMIT`: its fusedserve
    installed in `root`, started as `python -m fusedserve serve` from `root`, which goes first on its path so that
    its packages, not this tree's, are the ones imported."""
    root = Path(root).resolve()
    if not (root / "fusedserve" / "server" / "__main__.py").is_file():
        raise SystemExit(f"{root}: no fusedserve/server/__main__.py; a baseline is an older tree's fusedserve "
                         "installed there (python -m bench.gpu_assets --baseline COMMIT)")
    return ServerLaunch((sys.executable, "-m", "fusedserve", "serve"), cwd=str(root), path_first=str(root))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_ready(process: subprocess.Popen, url: str, deadline: float) -> bool:
    """Poll `url` until it answers 200 (True), or until `deadline` passes or `process` exits (False)."""
    while True:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or process.poll() is not None:
            return False
        time.sleep(0.3)


def _log_tail(path: str, chars: int = 3000) -> str:
    if path == os.devnull:
        return "(no log: pass --log-dir to keep one)"
    with contextlib.suppress(OSError):
        return Path(path).read_text(errors="replace")[-chars:]
    return "(log unreadable)"


@contextlib.contextmanager
def running_servers(count: int, log: str = os.devnull, *, launch: ServerLaunch = CURRENT,
                    ready_timeout_s: float = 480, log_level: str = "warning", cpus: frozenset[int] | None = None,
                    **settings: str):
    """`count` servers (this tree's `fusedserve serve` unless `launch` says otherwise) on free loopback ports with
    FUSEDSERVE_* settings, started together (replicas on one machine, as a Kubernetes node runs several pods), all
    writing to `log` (at `log_level`: "info" keeps the start-up report). Yields [(process, url)] once every one is
    ready (a first start on a fresh GPU machine compiles,
    self-tests and races the kernels before it is). cpus: the CPUs the servers (and their workers) may run on."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{f"FUSEDSERVE_{k.upper()}": v for k, v in settings.items()})
    env.pop("TRITON_INTERPRET", None)  # the harness's own switch on a CPU: a server chooses kernels as deployed
    env = launch.env(env)
    servers, handle = [], open(log, "a")
    try:
        for _ in range(count):
            port = free_port()
            process = subprocess.Popen([*launch.argv, "--port", str(port), "--log-level", log_level], env=env,
                                       cwd=launch.cwd, stdout=handle, stderr=subprocess.STDOUT,
                                       preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
            servers.append((process, f"http://127.0.0.1:{port}"))
        deadline = time.monotonic() + ready_timeout_s
        for process, url in servers:
            if not wait_until_ready(process, url + "/readyz", deadline):
                raise RuntimeError(f"server {' '.join(launch.argv)} did not become ready (exit code "
                                   f"{process.poll()}); its log {log} ends:\n{_log_tail(log)}")
        yield servers
    finally:
        for process, _ in servers:
            process.terminate()
        for process, _ in servers:
            process.wait(timeout=60)
        handle.close()


# ---- load -------------------------------------------------------------------------------------------------------
def request_body(payload: str, rows: list) -> tuple[str, dict]:
    """The route and JSON body of one request: "text" sends texts to /infer; "ids" sends token ids to the
    OpenAI route with base64 vectors (what a client that tokenizes itself sends: no tokenizer on the server)."""
    if payload in ("ids", "openai"):  # openai: texts, as OpenAI's client sends them (any compatible server: peer)
        return "/v1/embeddings", {"input": rows, "encoding_format": "base64"}
    return "/infer", {"inputs": rows}


async def closed_loop(urls: str | list[str], texts: list, clients: int, seconds: float, per_request: int,
                      count_tokens: list[int] | None = None, seed: int = 1, payload: str = "text") -> dict:
    """`clients` connections, each sending its next request when the last is answered, for `seconds`. Every
    client is one_connection_session's; with several servers (replicas) the clients are spread over them in turn, as a Kubernetes Service spreads connections. `texts` are strings, or
    token-id lists for payload "ids"; `count_tokens[i]` is the token count of `texts[i]`."""
    import aiohttp

    urls = [urls] if isinstance(urls, str) else urls
    latencies: list[float] = []
    errors = sent = 0
    stop = time.monotonic() + seconds
    rng = random.Random(seed)

    async def client_loop(url: str) -> None:
        nonlocal errors, sent
        async with one_connection_session(url) as session:
            while time.monotonic() < stop:
                picked = [rng.randrange(len(texts)) for _ in range(per_request)]
                route, body = request_body(payload, [texts[i] for i in picked])
                t = time.perf_counter()
                try:
                    async with session.post(route, json=body) as r:
                        await r.read()
                        status = r.status
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # counted, and the run goes on
                    errors += 1
                    print(f"client error: {type(exc).__name__}: {exc}", file=sys.stderr)
                    await asyncio.sleep(0.1)  # back off a server that refuses connections
                    continue
                if status == 200:
                    latencies.append(time.perf_counter() - t)
                    if count_tokens is not None:
                        sent += sum(count_tokens[i] for i in picked)
                else:
                    errors += 1

    started = time.monotonic()
    await asyncio.gather(*(client_loop(urls[(seed + i) % len(urls)]) for i in range(clients)))
    return {"latencies": latencies, "errors": errors, "elapsed": time.monotonic() - started, "tokens": sent}


def merge_runs(parts: list[dict]) -> dict:
    """The client processes' runs of one point as one: latencies and counts pooled, the longest elapsed time."""
    return {"latencies": [x for p in parts for x in p["latencies"]], "errors": sum(p["errors"] for p in parts),
            "elapsed": max(p["elapsed"] for p in parts), "tokens": sum(p["tokens"] for p in parts),
            "cpu": sum(p.get("cpu", 0.0) for p in parts)}


def client_shares(clients: int, processes: int) -> list[int]:
    """`clients` spread over `processes` as evenly as they go (some get none when there are fewer clients)."""
    return [clients // processes + (i < clients % processes) for i in range(processes)]


def _client_process(index: int, jobs, results, barrier) -> None:
    """A load-generator process: for each job (a coroutine function and its arguments) it waits until every
    process has its job, so they start together, then runs it and sends back (index, result or error)."""
    while (job := jobs.get()) is not None:
        function, args = job
        try:
            barrier.wait(timeout=300)
            results.put((index, asyncio.run(function(*args)), None))
        except BaseException as exc:  # reported to the parent, which raises it
            results.put((index, None, f"{type(exc).__name__}: {exc}"))


class ClientProcesses:
    """Load-generator processes, spawned once and given one job each per point (one Python process cannot drive
    hundreds of connections against a fast server without becoming the bottleneck itself). A barrier starts every
    process's clients at the same moment; the processes stay up between points, so a point pays no interpreter
    start. Use as a context manager."""

    def __init__(self, processes: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.barrier = context.Barrier(processes)
        self.jobs = [context.Queue() for _ in range(processes)]
        self.results = context.Queue()
        self.workers = [context.Process(target=_client_process, args=(i, jobs, self.results, self.barrier),
                                        daemon=True) for i, jobs in enumerate(self.jobs)]
        for worker in self.workers:
            worker.start()

    def __len__(self) -> int:
        return len(self.workers)

    def run(self, function: Callable[..., Coroutine], jobs: list[tuple], timeout_s: float) -> list[dict]:
        """`function(*jobs[i])` in process i, all started together; their results in process order. Raises if a
        process fails or none has answered within `timeout_s`."""
        self.submit(function, jobs)
        return self.collect(timeout_s)

    def submit(self, function: Callable[..., Coroutine], jobs: list[tuple]) -> None:
        """Start `function(*jobs[i])` in process i, all together, and return at once (collect() waits for them):
        the caller acts on the server while the load runs (the devices scenario's fault case)."""
        if len(jobs) != len(self.workers):
            raise ValueError(f"{len(jobs)} jobs for {len(self.workers)} client processes")
        for inbox, args in zip(self.jobs, jobs, strict=True):
            inbox.put((function, args))

    def collect(self, timeout_s: float) -> list[dict]:
        """The submitted jobs' results in process order."""
        parts: dict[int, dict] = {}
        deadline = time.monotonic() + timeout_s
        while len(parts) < len(self.workers):
            try:  # a second at a time, so that a process that died is noticed at once
                index, result, error = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [i for i, w in enumerate(self.workers) if not w.is_alive()]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"client processes: {len(self.workers) - len(parts)} gave no result"
                                       + (f" (processes {dead} exited)" if dead else f" in {timeout_s:.0f} s")
                                       ) from None
                continue
            if error is not None:
                raise RuntimeError(f"client process {index}: {error}")
            parts[index] = result
        return [parts[i] for i in range(len(self.workers))]

    def close(self) -> None:
        for inbox in self.jobs:
            inbox.put(None)
        for worker in self.workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
                worker.join()

    def __enter__(self) -> ClientProcesses:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load(urls: str | list[str], texts: list, clients: int, seconds: float, per_request: int,
         count_tokens: list[int] | None = None, processes: int = 1, payload: str = "text") -> dict:
    """closed_loop, spread over `processes` load-generator processes that start together."""
    processes = max(1, min(processes, clients))
    if processes == 1:
        return asyncio.run(closed_loop(urls, texts, clients, seconds, per_request, count_tokens, 1, payload))
    jobs = [(urls, texts, n, seconds, per_request, count_tokens, i + 1, payload)
            for i, n in enumerate(client_shares(clients, processes))]
    with ClientProcesses(processes) as pool:
        return merge_runs(pool.run(closed_loop, jobs, timeout_s=seconds + 300))


# what -> (sample name, labels it must carry): summed over every other label (the model, a replica's worker)
CHECK_RESULTS = ("match", "mismatch", "error", "dropped")  # fusedserve_reference_checks_total's `result` values
SERVER_SUMS = {
    "request": ("fusedserve_request_duration_seconds_sum", {"route": "{route}"}),
    "requests": ("fusedserve_request_duration_seconds_count", {"route": "{route}"}),
    "queue": ("fusedserve_queue_duration_seconds_sum", {}), "inputs": ("fusedserve_queue_duration_seconds_count", {}),
    "batch_size": ("fusedserve_batch_size_sum", {}), "batches": ("fusedserve_batch_size_count", {}),
    "forward": ("fusedserve_forward_duration_seconds_sum", {}),
    "cpu": ("process_cpu_seconds_total", {}),  # the server process's user + system CPU time (prometheus_client)
    "workers_cpu": ("fusedserve_worker_cpu_seconds", {}),  # the same summed over WORKERS > 1 (multiprocess mode)
    # the verifier's sampled checks (VERIFY_SAMPLE_RATE), by outcome
    **{f"checks_{result}": ("fusedserve_reference_checks_total", {"result": result}) for result in CHECK_RESULTS},
}


def server_sums(urls: str | list[str], route: str = "/infer") -> dict[str, float]:
    """Counters and histogram sums of the servers' /metrics that the per-run breakdown is built from (summed over
    replicas, models and any other label), parsed by prometheus-client's own exposition parser."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: collections.Counter = collections.Counter({k: 0.0 for k in SERVER_SUMS})
    for url in [urls] if isinstance(urls, str) else urls:
        text = httpx.get(url + "/metrics", timeout=30).text
        server: collections.Counter = collections.Counter()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                for what, (name, labels) in SERVER_SUMS.items():
                    if sample.name == name and all(sample.labels.get(k) == v.format(route=route)
                                                   for k, v in labels.items()):
                        server[what] += sample.value
        if server["workers_cpu"]:  # several workers: process_* describes only the one that answered the scrape
            server["cpu"] = server["workers_cpu"]
        totals.update(server)
    del totals["workers_cpu"]
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
