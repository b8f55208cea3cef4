"""The heap trimmer: a burst of large requests is followed by one malloc_trim, on a worker thread."""

from __future__ import annotations

import asyncio
import threading

from fusedserve.server import heap
from tests.waiting import wait_until_async


def test_a_burst_of_large_requests_is_trimmed_once_after_it(monkeypatch):
    monkeypatch.setattr(heap, "TRIM_DELAY_S", 0.05)
    calls: list[tuple[int, bool]] = []
    trimmer = heap.HeapTrimmer()
    trimmer._trim = lambda pad: calls.append((pad, threading.current_thread() is threading.main_thread()))

    async def until_trims(n: int) -> None:
        await wait_until_async(lambda: trimmer.trims >= n, 10, lambda: f"{trimmer.trims} trims, not {n}")
        # and no further trim follows: an absence can only be watched for a while (twice TRIM_DELAY_S here, past
        # which another trim of the same burst would have run)
        await asyncio.sleep(2 * heap.TRIM_DELAY_S)

    async def burst() -> None:
        for _ in range(5):
            trimmer.after_large_request()
        await until_trims(1)
        trimmer.after_large_request()  # a later one: another trim
        await until_trims(2)

    asyncio.run(burst())
    assert calls == [(0, False), (0, False)] and trimmer.trims == 2


def test_glibc_has_malloc_trim_here():
    """This machine and the images run glibc: the trimmer is not silently a no-op where it matters."""
    assert heap._malloc_trim() is not None
