"""Load (CI-sized): 200 concurrent clients, mixed lengths from 1 to ~500 tokens, random client
cancellations. Every request that was not cancelled is answered once with exactly its own inputs'
single-request embeddings; no 5xx; memory growth is reported and bounded. Overload: above capacity only
429 (with Retry-After) beyond the queue bound, no hang, and recovery once load drops.
The long run is bench/load.py."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from bench.load import check, rss_bytes, run_clients, texts_of_mixed_length
from tests.tolerances import tolerance

CLIENTS = 200
SECONDS = 12


@pytest.mark.slow
def test_200_clients_mixed_lengths_with_cancellations(make_server):
    # 200 clients keep ~200 requests queued, and on 2 busy cores the last of them can wait past the default 30 s
    # (seen once, with a second test run sharing the cores: 92 of 318 answers were 504). This test is about every
    # request being answered once with its own result, so the timeout is out of the way
    server = make_server(max_batch_tokens=8192, max_queue=4096, request_timeout_s=100)  # clients wait 120 s
    pool = texts_of_mixed_length(40)
    singles = {t: torch.tensor(httpx.post(server.url + "/infer", json={"inputs": [t]}, timeout=60).json()["embeddings"][0])
               for t in pool}
    rss_before = rss_bytes(server.process.pid)
    outcomes, cancelled = asyncio.run(run_clients(server.url, pool, CLIENTS, SECONDS, cancel_rate=0.1))
    rss_after = rss_bytes(server.process.pid)
    statuses = [r.status_code for _, r, _ in outcomes]
    print(f"\n{len(outcomes)} answered requests ({cancelled} cancelled) from {CLIENTS} clients in {SECONDS}s; "
          f"RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB")
    assert len(outcomes) >= CLIENTS  # every client got at least one answer
    assert set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
    assert cancelled > 0
    assert check(outcomes, singles, atol=tolerance().max_abs) == 0  # every answer is its inputs' own embeddings
    assert rss_after - rss_before < 300 * 2**20
    # the server is healthy and idle afterwards
    metrics = httpx.get(server.url + "/metrics").text
    assert 'fusedserve_queue_depth{model="all-MiniLM-L6-v2"} 0.0' in metrics


def test_overload_answers_429_then_recovers(make_server):
    server = make_server(max_queue=16, max_batch_requests=8)
    pool = texts_of_mixed_length(20)

    async def flood():
        # no hang: each request's timeout bounds the flood. How long an accepted one took depends on the machine's
        # load; that none passed the server's request deadline shows as no 504 below
        async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                     limits=httpx.Limits(max_connections=CLIENTS)) as client:
            return await asyncio.gather(*(client.post("/infer", json={"inputs": [pool[i % 20]]})
                                          for i in range(CLIENTS)))

    responses = asyncio.run(flood())
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429} and statuses.count(429) > 0 and statuses.count(200) >= 16
    assert all(r.headers["retry-after"] == "1" for r in responses if r.status_code == 429)
    # recovers once the flood is over: answered, and nothing left waiting
    assert httpx.post(server.url + "/infer", json={"inputs": ["calm again"]}, timeout=30).status_code == 200
    assert 'fusedserve_queue_depth{model="all-MiniLM-L6-v2"} 0.0' in httpx.get(server.url + "/metrics").text
