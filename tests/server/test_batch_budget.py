"""The batch token budget: real tokens with the packed layout (no op sees padding), rows x longest row with the
padded layout; the window of similar lengths around the oldest input either way."""

from __future__ import annotations

import asyncio

import pytest

from model.runner import Embedder
from server.batcher import Batcher, Item, Job
from server.config import Settings
from server.metrics import Metrics


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _batcher(layout: str, max_batch_tokens: int) -> Batcher:
    embedder, _ = Embedder.load("tiny", device="cpu", layout=layout)
    return Batcher(embedder, Settings(max_batch_tokens=max_batch_tokens, max_batch_requests=64), Metrics())


def _queue(batcher: Batcher, loop, lengths: list[int]) -> list[Item]:
    job = Job([[1] * n for n in lengths], True, 1e12, loop.create_future(), loop)
    items = [Item(job, i, n, float(i)) for i, n in enumerate(lengths)]
    batcher._pending = list(items)
    return items


@pytest.mark.parametrize("layout, expected", [("packed", 4), ("padded", 1)])
def test_budget_counts_real_tokens_when_packed(layout, expected, loop):
    # the oldest input has 100 tokens, the others 10. Packed: 100 + 3 x 10 = 130 fits a budget of 130, a fourth
    # 10 does not. Padded: two rows already cost 2 x 100 = 200, so the oldest goes alone.
    batcher = _batcher(layout, 130)
    items = _queue(batcher, loop, [100, 10, 10, 10, 10])
    batch = batcher._choose(items[0])
    assert items[0] in batch and len(batch) == expected


def test_similar_lengths_first_under_either_budget(loop):
    batcher = _batcher("packed", 60)
    items = _queue(batcher, loop, [20, 5, 19, 21, 40])
    assert sorted(it.length for it in batcher._choose(items[0])) == [19, 20, 21]
