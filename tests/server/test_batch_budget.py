"""The batch token budget: real tokens (models run batches packed, so no op sees padding), and the window of
similar lengths around the oldest input."""

from __future__ import annotations

import asyncio
import random

import pytest

from fusedserve.model import load
from fusedserve.model.api import LoadOptions, Rows
from fusedserve.server.batch_policy import Limits, window
from fusedserve.server.batcher import Batcher, Item, Job
from fusedserve.server.config import Settings
from fusedserve.server.metrics import Metrics


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def model():
    return load("tiny", LoadOptions(device="cpu"))


def _batcher(model, max_batch_tokens: int) -> Batcher:
    return Batcher(model, Settings(max_batch_tokens=max_batch_tokens, max_batch_requests=64),
                   Metrics().for_model("tiny"))


def _queue(batcher: Batcher, loop, lengths: list[int]) -> list[Item]:
    job = Job(Rows.of([[1] * n for n in lengths]), 1e12, loop.create_future(), loop)
    items = [Item(job, i, n, float(i)) for i, n in enumerate(lengths)]
    batcher._pending = list(items)
    return items


def test_budget_counts_real_tokens(model, loop):
    # the oldest input has 100 tokens, the others 10: 100 + 3 x 10 = 130 fits a budget of 130, a fourth 10 does not
    # (padded, two rows would already cost 2 x 100)
    batcher = _batcher(model, 130)
    items = _queue(batcher, loop, [100, 10, 10, 10, 10])
    batch = window(batcher._pending, items[0], Limits.of(batcher.settings))
    assert items[0] in batch and len(batch) == 4


def test_similar_lengths_first(model, loop):
    batcher = _batcher(model, 60)
    items = _queue(batcher, loop, [20, 5, 19, 21, 40])
    assert sorted(it.length for it in window(batcher._pending, items[0], Limits.of(batcher.settings))) == [19, 20, 21]


def test_each_batch_holds_the_oldest_input_and_a_window_of_similar_lengths(model, loop):
    # 600 inputs of random lengths in arrival order (as submit keeps them): every batch taken holds the oldest input
    # still waiting, and is a contiguous run of the waiting inputs ordered by (length, arrival)
    batcher = _batcher(model, 2048)
    rng = random.Random(7)
    items = _queue(batcher, loop, [rng.randint(1, 200) for _ in range(600)])
    waiting = list(items)
    with batcher._cond:
        while batcher._pending:
            ordered = sorted(waiting, key=lambda it: (it.length, it.enqueued))
            batch = batcher._next_batch()
            assert waiting[0] in batch
            start = ordered.index(min(batch, key=lambda it: (it.length, it.enqueued)))
            assert ordered[start : start + len(batch)] == sorted(batch, key=lambda it: (it.length, it.enqueued))
            assert sum(it.length for it in batch) <= 2048
            taken = set(map(id, batch))
            waiting = [it for it in waiting if id(it) not in taken]
    assert not waiting


def test_the_oldest_goes_first_among_many_of_its_length(model, loop):
    # 41 inputs of one length and a budget for 10 of them: the batch is the 10 that arrived first, oldest included
    batcher = _batcher(model, 500)
    items = _queue(batcher, loop, [50] * 41)
    with batcher._cond:
        assert batcher._next_batch() == items[:10]


def test_a_newcomer_does_not_wait_for_every_batch_of_a_large_request(model, loop):
    """A request of 300 long inputs whose first batch has run, then one-input requests: the next batch is built
    around the newcomers and holds only them, the one after around the large request's oldest input, and so on
    alternately."""
    batcher = _batcher(model, 2048)
    large = _queue(batcher, loop, [100] * 300)
    large[0].job.started = 0.0  # its first batch ran
    small_job = Job(Rows.of([[1] * 10]), 1e12, loop.create_future(), loop)
    small = Item(small_job, 0, 10, 1e6)
    second_job = Job(Rows.of([[1] * 10]), 1e12, loop.create_future(), loop)
    second = Item(second_job, 0, 10, 2e6)
    batcher._pending.extend([small, second])
    with batcher._cond:
        first = batcher._next_batch()
        assert first == [small, second]  # built around the newcomer, of newcomers only
        small_job.started = second_job.started = 0.0
        oldest = batcher._pending[0]
        assert oldest.job is large[0].job and oldest in batcher._next_batch()  # the large request's turn
        third = Item(Job(Rows.of([[1] * 150]), 1e12, loop.create_future(), loop), 0, 150, 3e6)
        batcher._pending.append(third)
        assert batcher._next_batch() == [third]  # a newcomer again
        oldest = batcher._pending[0]
        assert oldest in batcher._next_batch()  # and the oldest again


def test_work_between_batches_whose_caller_gave_up_is_skipped_and_the_worker_lives_on(model):
    """A between-batches future cancelled before the worker reaches it (its request gone, its deadline passed) is
    skipped: settling it would raise on the worker's thread and end the worker."""
    batcher = _batcher(model, 2048)
    ran = []
    with batcher._cond:  # queued before the worker starts: it meets the cancelled future first
        given_up = batcher.between_batches(lambda: ran.append("given up"))
        assert given_up.cancel()
        later = batcher.between_batches(lambda: ran.append("later") or "done")
    batcher.start()
    try:
        assert later.result(timeout=30) == "done" and ran == ["later"]
        assert batcher.between_batches(lambda: "still serving").result(timeout=30) == "still serving"
    finally:
        batcher.drain(timeout_s=10)
