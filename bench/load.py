"""Long load run against the real server: N concurrent clients (default 200) for S seconds (default 60),
mixed lengths from 1 to ~500 words, a share of clients giving up early (cancellations). Checks every
answer against that input's single-request embedding and reports throughput, latency, status counts and
the server's RSS growth.

    python -m bench.load --clients 200 --seconds 60 --out bench/results/$(date +%F)-cpu-load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

from bench import command, save
from bench.serve import running_server


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def texts_of_mixed_length(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = "alpha beta gamma delta kernel fused batch token layer norm vector serve".split()
    lengths = [1, 2, 5, 10, 20, 40, 80, 160, 300, 500]  # words; the longest pass 256 tokens and are truncated
    return [" ".join(rng.choice(words) for _ in range(lengths[i % len(lengths)])) + f" #{i}" for i in range(n)]


async def run_clients(url: str, pool: list[str], clients: int, seconds: float, cancel_rate: float, seed: int = 1):
    """Closed-loop clients; returns [(texts, response, seconds)] for requests not cancelled, and the count of
    cancelled ones."""
    rng = random.Random(seed)
    outcomes: list[tuple[list[str], httpx.Response, float]] = []
    cancelled = 0
    stop = time.monotonic() + seconds

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal cancelled
        while time.monotonic() < stop:
            texts = rng.sample(pool, rng.randint(1, 3))
            if rng.random() < cancel_rate:
                try:  # give up early: the client closes its connection
                    await asyncio.wait_for(client.post("/infer", json={"inputs": texts}), timeout=rng.uniform(0.01, 0.3))
                except asyncio.TimeoutError:
                    cancelled += 1
                continue
            t = time.perf_counter()
            response = await client.post("/infer", json={"inputs": texts})
            outcomes.append((texts, response, time.perf_counter() - t))

    limits = httpx.Limits(max_connections=clients + 10, max_keepalive_connections=clients + 10)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    return outcomes, cancelled


def check(outcomes, singles: dict[str, torch.Tensor]) -> int:
    """How many answered inputs differ from their single-request embedding by more than 1e-5."""
    wrong = 0
    for texts, response, _ in outcomes:
        if response.status_code != 200:
            continue
        got = torch.tensor(response.json()["embeddings"])
        wrong += sum(float((row - singles[t]).abs().max()) > 1e-5 for t, row in zip(texts, got, strict=True))
    return wrong


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--cancel-rate", type=float, default=0.1)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    with running_server(max_batch_tokens="8192") as (server, url):
        pool = texts_of_mixed_length(40)
        singles = {t: torch.tensor(httpx.post(url + "/infer", json={"inputs": [t]}, timeout=60).json()["embeddings"][0])
                   for t in pool}
        rss_before = rss_bytes(server.pid)
        started = time.monotonic()
        outcomes, cancelled = asyncio.run(run_clients(url, pool, args.clients, args.seconds, args.cancel_rate))
        elapsed = time.monotonic() - started
        rss_after = rss_bytes(server.pid)
    statuses: dict[str, int] = {}
    for _, r, _ in outcomes:
        statuses[str(r.status_code)] = statuses.get(str(r.status_code), 0) + 1
    latencies = sorted(s for _, r, s in outcomes if r.status_code == 200)
    q = statistics.quantiles(latencies, n=100)
    report = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} cores, CPU", "clients": args.clients,
        "seconds": elapsed, "cancel_rate": args.cancel_rate, "answered": len(outcomes), "cancelled": cancelled,
        "statuses": statuses, "wrong_answers": check(outcomes, singles),
        "requests_per_s": len(outcomes) / elapsed, "p50_ms": q[49] * 1e3, "p99_ms": q[98] * 1e3,
        "rss_before_mib": rss_before / 2**20, "rss_after_mib": rss_after / 2**20,
        "command": command("load", argv),
    }
    save(report, args.out)
    print(json.dumps(report, indent=1))
    return 0 if report["wrong_answers"] == 0 and set(statuses) == {"200"} else 1


if __name__ == "__main__":
    sys.exit(main())
