"""The soak workload (`python -m bench serve soak`, and the CI-sized tests/load): closed-loop clients of 1-3
mixed-length texts (1 to ~500 words) per request, a share of them giving up early, and the check of every answer
against its input's single-request embedding."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.harness import one_connection_session


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


@dataclass(frozen=True)
class Answer:
    """One answered request: its status and JSON body (None when the body is not JSON)."""

    status_code: int
    body: dict | None


async def run_clients(url: str, pool: list[str], clients: int, seconds: float, cancel_rate: float, seed: int = 1
                      ) -> tuple[list[tuple[list[str], Answer, float]], int]:
    """Closed-loop clients, each a session of one connection (bench.harness.one_connection_session); returns [(texts, answer, seconds)] for requests not cancelled, and the count of
    cancelled ones."""
    import aiohttp

    rng = random.Random(seed)
    outcomes: list[tuple[list[str], Answer, float]] = []
    cancelled = 0
    stop = time.monotonic() + seconds

    async def post(session: aiohttp.ClientSession, texts: list[str]) -> Answer:
        async with session.post("/infer", json={"inputs": texts}) as r:
            body = await r.json(content_type=None) if r.content_type == "application/json" else None
            return Answer(r.status, body)

    async def client_loop() -> None:
        nonlocal cancelled
        async with one_connection_session(url) as session:
            while time.monotonic() < stop:
                texts = rng.sample(pool, rng.randint(1, 3))
                if rng.random() < cancel_rate:
                    try:  # give up early: the client drops its connection mid-request
                        await asyncio.wait_for(post(session, texts), timeout=rng.uniform(0.01, 0.3))
                    except asyncio.TimeoutError:
                        cancelled += 1
                    continue
                t = time.perf_counter()
                answer = await post(session, texts)
                outcomes.append((texts, answer, time.perf_counter() - t))

    await asyncio.gather(*(client_loop() for _ in range(clients)))
    return outcomes, cancelled


def check(outcomes, singles: dict[str, torch.Tensor], atol: float = 1e-5) -> int:
    """How many answered inputs differ from their single-request embedding by more than `atol` (any element)."""
    wrong = 0
    for texts, response, _ in outcomes:
        if response.status_code != 200:
            continue
        got = torch.tensor(response.body["embeddings"])
        wrong += sum(float((row - singles[t]).abs().max()) > atol for t, row in zip(texts, got, strict=True))
    return wrong
