"""The serving stack without a GPU: the real server (FastAPI, uvicorn, tokenizer, batcher, worker thread) with the
model's forward replaced by a stand-in device, measured two ways.

    python -m bench.single_latency --forward-ms 0.25 --out bench/results/$(date +%F)-cpu-single-latency.json
    python -m bench.single_latency --load 64 --rate 6.87e6 --out bench/results/$(date +%F)-cpu-stub-load.json

Single requests (the default): one 20-word text at a time to POST /infer, from httpx and from the standard
library's http.client (whose own cost per request is far smaller), next to GET /healthz round trips; the
stand-in takes --forward-ms per batch (a b1 graph replay's length).

--load N: N closed-loop clients sending 16 token-id rows of the GPU traffic mix per request to /v1/embeddings
(bench.serve's "ids" payload), the stand-in taking tokens / --rate seconds per batch (the H200 runner's raw
tokens/s), and the server process's CPU time per request from its own process_cpu_seconds_total. That CPU
time, not the device, is what caps one server: a process whose event loop and worker share one GIL serves at
most 1000 / (CPU ms per request) requests/s. The server runs on one core and the load generator on the others
(with 2+ cores); on a 2-core machine the request rate is then the load generator's, the CPU per request the
server's.

The stand-in is a serial device: a launch queues behind the previous one and returns a result that is ready
when its time is up (the batcher overlaps batches as it does with CUDA graphs); it returns ones, so the
batcher's delivery, normalization and JSON run as usual. This measures the serving stack, not the model: on the
H200 `python -m bench.serve --device cuda` measures the real one.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

from bench import command, save
from bench.serve import load, measured_load, mixed_texts, running_servers, sentences, single_requests


class _Done:
    """A stand-in for the CUDA event a launched batch records: ready once its device time has passed."""

    def __init__(self, at: float) -> None:
        self.at = at

    def query(self) -> bool:
        return time.perf_counter() >= self.at

    def synchronize(self) -> None:
        time.sleep(max(self.at - time.perf_counter(), 0.0))


def _serve(forward_s: float, rate: float, argv: list[str]) -> None:
    """The server with Embedder.launch_ids replaced by the serial stand-in device (run in the child process):
    a batch takes forward_s, plus its tokens / rate when rate > 0."""
    import torch

    import model.runner as runner
    from server.__main__ import main

    lock, free_at = threading.Lock(), [0.0]

    def launch_ids(self, batch, *, graphs=True):
        with lock:
            free_at[0] = max(time.perf_counter(), free_at[0]) + forward_s + (sum(map(len, batch)) / rate if rate else 0)
            done = _Done(free_at[0])
        return runner.Pending(torch.ones(len(batch), self.config.hidden_size), done)

    runner.Embedder.launch_ids = launch_ids
    sys.exit(main(argv))


def _stub_servers(forward_ms: float, rate: float = 0.0):
    command = [sys.executable, "-m", "bench.single_latency", "--serve", str(forward_ms / 1e3), str(rate)]
    return running_servers(1, command=command, device="cpu", kernel_timing_sample_rate="0", verify_sample_rate="0",
                           drain_delay_s="0", max_batch_requests="256", max_batch_tokens="16384", max_queue="65536")


def measure(forward_ms: float, count: int) -> dict:
    """bench.serve's single-request split (httpx, the server's own account, http.client) against the stub server."""
    with _stub_servers(forward_ms) as servers:
        single = single_requests(servers[0][1], sentences(1, 20), count)
    return {"forward_ms": forward_ms, "requests": count, "server": single["server"],
            "httpx": {"infer_p50_ms": single["p50_ms"], "infer_p99_ms": single["p99_ms"],
                      "healthz_p50_ms": single["healthz_p50_ms"]},
            "http_client": single["raw_client"]}


def _pin_apart(server_pid: int) -> bool:
    """With 2+ cores: every thread of the server on core 0, this process (the load generator) on the others, so the
    two do not take turns on one core (which made the CPU per request vary by ~25% run to run). False if not
    possible (one core, or no affinity calls on this platform)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < 2:
        return False
    for task in os.listdir(f"/proc/{server_pid}/task"):
        os.sched_setaffinity(int(task), {cores[0]})
    os.sched_setaffinity(0, set(cores[1:]))
    return True


def measure_load(clients: int, rate: float, seconds: float, per_request: int = 16, texts: int = 4096) -> dict:
    """N closed-loop clients of token-id requests against the stub server: rates, latency and the server's split
    and CPU time per request (bench.serve.server_breakdown)."""
    from model.tokenizer import TextTokenizer
    from model.weights import default_model_dir

    ids = TextTokenizer(default_model_dir(), 256).encode(mixed_texts(texts))
    tokens = list(map(len, ids))
    mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        with _stub_servers(0.0, rate) as servers:
            url = servers[0][1]
            pinned = _pin_apart(servers[0][0].pid)
            load(url, ids, clients, 2, per_request, payload="ids")  # warm
            run, inside = measured_load(url, ids, clients, seconds, per_request, tokens, payload="ids")
    finally:
        if mine is not None:
            os.sched_setaffinity(0, mine)
    answered = len(run["latencies"])
    return {"clients": clients, "per_request": per_request, "stub_tokens_per_s": rate, "seconds": run["elapsed"],
            "requests": answered, "errors": run["errors"], "requests_per_s": answered / run["elapsed"],
            "tokens_per_s": run["tokens"] / run["elapsed"], "server": inside, "server_pinned_to_core_0": pinned,
            "cpu_bound_requests_per_s": 1e3 / inside["cpu_ms_per_request"]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:  # the child: the server itself
        _serve(float(argv[1]), float(argv[2]), argv[3:])
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.single_latency", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forward-ms", type=float, default=0.25, help="the forward's stand-in (default: a b1 replay)")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--load", type=int, metavar="CLIENTS", help="closed-loop token-id load instead")
    parser.add_argument("--rate", type=float, default=6.87e6, help="--load: the stand-in device's tokens/s")
    parser.add_argument("--seconds", type=float, default=8.0, help="--load: measured seconds")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    machine = f"{os.cpu_count()} cores, no GPU (forward stubbed)"
    if args.load:
        report = {"date": time.strftime("%Y-%m-%d"), "machine": machine,
                  **measure_load(args.load, args.rate, args.seconds), "command": command("single_latency", argv)}
        save(report, args.out)
        s = report["server"]
        print(f"{args.load} clients, 16 token-id rows per request: {report['requests_per_s']:.0f} requests/s, "
              f"{report['tokens_per_s'] / 1e6:.2f} M tokens/s ({100 * report['tokens_per_s'] / args.rate:.0f}% of the "
              f"stand-in's {args.rate / 1e6:g} M); server CPU {s['cpu_ms_per_request']:.2f} ms/request "
              f"({s['cpu_cores']:.2f} cores) -> at most {report['cpu_bound_requests_per_s']:.0f} requests/s per "
              f"process; {s['batches']:.0f} batches of {s['inputs_per_batch']:.0f} inputs")
        return 0
    report = {"date": time.strftime("%Y-%m-%d"), "machine": machine,
              **measure(args.forward_ms, args.requests), "command": command("single_latency", argv)}
    save(report, args.out)
    h, r = report["httpx"], report["http_client"]
    print(f"POST /infer (one 20-word text) p50: httpx {h['infer_p50_ms']:.2f} ms, http.client {r['infer_p50_ms']:.2f} "
          f"ms; GET /healthz p50: httpx {h['healthz_p50_ms']:.2f}, http.client {r['healthz_p50_ms']:.2f}; forward "
          f"stand-in {args.forward_ms:g} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
