"""idle_poll_ms: after each batch the worker waits for the next one in short timed waits for that long, then
sleeps until notified as usual. Requests arriving during and after the window are served, each with its own
result; with the setting off the worker never polls."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from model.runner import Embedder
from server import batcher as batcher_module
from server.batcher import Batcher
from server.config import Settings
from server.metrics import Metrics


@pytest.fixture(scope="module")
def embedder():
    e, _ = Embedder.load("tiny", device="cpu")
    return e


def _serve(embedder, idle_poll_ms: float, pauses_s: list[float]) -> tuple[list, list[tuple[float, float | None]]]:
    """One request after each pause; returns the results and the worker's (time, timeout) condition waits."""
    settings = Settings(model="tiny", device="cpu", idle_poll_ms=idle_poll_ms, kernel_timing_sample_rate=0)
    batcher = Batcher(embedder, settings, Metrics())
    waits: list[tuple[float, float | None]] = []
    cond_wait = batcher._cond.wait

    def recorded_wait(timeout=None):
        waits.append((time.monotonic(), timeout))
        return cond_wait(timeout)

    batcher._cond.wait = recorded_wait
    rows = [[101, 7592 + 5 * i, 2088 + 3 * i, 102] for i in range(len(pauses_s))]

    async def main():
        batcher.start()
        results = []
        for row, pause in zip(rows, pauses_s):
            await asyncio.sleep(pause)
            job = batcher.submit([row], normalize=False, timeout_s=30)
            results.append(await asyncio.wait_for(job.future, 30))
        await asyncio.sleep(0.15)  # past every window: the worker goes back to sleeping
        return results

    results = asyncio.run(main())
    assert batcher.drain(5)
    for row, got in zip(rows, results):
        np.testing.assert_allclose(got[0], embedder.embed_ids([row], normalize=False)[0].numpy(), rtol=1e-5,
                                   atol=1e-6)
    return results, waits


def test_the_worker_polls_within_the_window_then_sleeps(embedder):
    # the second request lands inside the first one's 40 ms window, the third long after it
    results, waits = _serve(embedder, 40, [0.0, 0.01, 0.1])
    assert not np.allclose(results[0], results[1]) and not np.allclose(results[1], results[2])
    polls = [t for t, timeout in waits if timeout is not None]
    assert polls and all(timeout <= batcher_module.IDLE_POLL_US / 1e6 for _, timeout in waits if timeout is not None)
    assert len(polls) > 20  # many short waits, not one long one
    # after the last batch the polls stop within the window (plus scheduling slack) and an untimed wait follows
    assert waits[-1][1] is None
    assert polls[-1] - polls[0] < 0.5
    # and between the windows (the ~90 ms before the third request) it slept
    assert max(b - a for a, b in zip(polls, polls[1:])) > 0.05


def test_without_the_setting_the_worker_only_sleeps(embedder):
    _, waits = _serve(embedder, 0, [0.0, 0.02])
    assert waits and all(timeout is None for _, timeout in waits)
