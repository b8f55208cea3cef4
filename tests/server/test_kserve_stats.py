"""The statistics bracket both KServe transports count their infer calls with (kserve_common.Stats.counted): a
success counts its inputs and its time, an exception a failure, and a cancelled call (its client left) neither."""

from __future__ import annotations

import asyncio

import pytest

from fusedserve.server.errors import BadRequest
from fusedserve.server.kserve_common import Stats


def test_a_success_counts_its_inputs_and_time_a_failure_its_time():
    stats = Stats()
    with stats.counted() as inference:
        inference.inputs = 3
    assert (stats.success, stats.inferences, stats.fail) == (1, 3, 0)
    assert stats.success_ns > 0 and stats.last_ms > 0
    with pytest.raises(BadRequest), stats.counted():
        raise BadRequest("no such input")
    assert (stats.success, stats.inferences, stats.fail) == (1, 3, 1) and stats.fail_ns > 0


def test_a_cancelled_call_counts_as_neither():
    stats = Stats()

    async def call():
        with stats.counted() as inference:
            await asyncio.sleep(10)
            inference.inputs = 1

    async def cancelled():
        task = asyncio.create_task(call())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled())
    assert (stats.success, stats.fail, stats.inferences) == (0, 0, 0)
