"""Which waiting inputs form the next batch, as pure functions of the queue: no thread, lock, clock or model. The
batcher's worker (server.batcher) calls `next_batch` under its lock, takes the batch when it is due and waits
otherwise; the tests hold the rules on plain data.

The rules:
- the batch is built around a seed: the oldest waiting input; but where a request none of whose inputs has run yet
  (a newcomer) waits, every other batch is built around the oldest newcomer, and holds newcomers only (`seed`);
- around the seed, the window of similar lengths: inputs ordered by length (then arrival), grown one neighbour at a
  time toward the closer length (the shorter one on ties: it adds no padding) while the real tokens fit
  `max_batch_tokens` and the inputs `max_batch_requests` (`window`);
- a batch is due when it is full (it holds `max_batch_requests` inputs, another input as long as its longest would
  pass `max_batch_tokens`, or waiting inputs were left out of it), when its seed has waited `max_wait_ms`, or when
  the batcher drains (`next_batch`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Protocol, TypeVar


class Request(Protocol):
    """What the policy reads of a waiting input's request (server.batcher.Job)."""

    @property
    def started(self) -> float | None: ...  # when its first batch started; None: a newcomer, none of it has run


class Waiting(Protocol):
    """What the policy reads of a waiting input (server.batcher.Item). Plain attributes: the policy reads them for
    every waiting input, thousands under a backlog, on the worker's path between two batches."""

    @property
    def length(self) -> int: ...  # its tokens

    @property
    def enqueued(self) -> float: ...  # time.monotonic() when it was queued

    @property
    def job(self) -> Request: ...


W = TypeVar("W", bound=Waiting)


@dataclass(frozen=True)
class Limits:
    """The settings the policy follows (server.config.Settings' batching group)."""

    max_batch_tokens: int
    max_batch_requests: int
    max_wait_ms: float

    @classmethod
    def of(cls, settings) -> Limits:
        return cls(settings.max_batch_tokens, settings.max_batch_requests, settings.max_wait_ms)


@dataclass(frozen=True)
class Choice:
    """The batch the queue would give now, and whether to take it."""

    batch: list  # the inputs, ordered by length, then arrival
    newcomers: bool  # built around a newcomer: the next batch is the oldest's (next_batch's oldest_next)
    due: bool  # take it now; else wait up to `wait_s` for company
    wait_s: float  # seconds until its seed has waited max_wait_ms (meaningful when not due)


def seed(pending: Sequence[W], oldest_next: bool) -> tuple[W, bool]:
    """The input the next batch is built around, and whether it is a newcomer's taking its turn ahead of the oldest.
    `pending` is in arrival order; `oldest_next`: the last batch was a newcomer's turn. The oldest waiting input; but
    where a newcomer waits, every other batch is built around its oldest input: otherwise a one-input request that
    comes after a request of hundreds of long inputs waits for all of that request's batches. Alternating keeps the
    large request moving while newcomers keep coming."""
    oldest = pending[0]
    if oldest_next or oldest.job.started is None:
        return oldest, False
    newcomer = next((it for it in pending if it.job.started is None), None)
    return (oldest, False) if newcomer is None else (newcomer, True)


def window(pending: Sequence[W], around: W, limits: Limits, newcomers: bool = False) -> list[W]:
    """The window of similar lengths around `around` (among newcomers only, with `newcomers`: a newcomer's batch
    filled up with a large request's inputs would take as long as that request's own batches) that fits the token
    and input budgets. `pending` is in arrival order."""
    pool = [it for it in pending if it.job.started is None] if newcomers else pending
    # a stable sort of the arrival-ordered queue: by length, then arrival (cheaper than a (length, enqueued) key at
    # thousands of waiting inputs); the seed is the first of its length (the oldest, or the oldest newcomer)
    by_length = sorted(pool, key=attrgetter("length"))
    lo = hi = bisect.bisect_left([it.length for it in by_length], around.length)
    longest = total = around.length
    while hi - lo + 1 < limits.max_batch_requests:
        left = by_length[lo - 1] if lo > 0 else None
        right = by_length[hi + 1] if hi + 1 < len(by_length) else None
        if left is None and right is None:
            break
        # take the neighbour closer in length (the shorter one on ties: it adds no padding)
        if right is None or (left is not None and around.length - left.length <= right.length - around.length):
            candidate_longest, step, added = longest, "left", left.length
        else:
            candidate_longest, step, added = max(longest, right.length), "right", right.length
        if total + added > limits.max_batch_tokens:
            break
        longest, total = candidate_longest, total + added
        if step == "left":
            lo -= 1
        else:
            hi += 1
    return by_length[lo : hi + 1]


def next_batch(pending: Sequence[W], limits: Limits, *, now: float, oldest_next: bool = False,
               draining: bool = False) -> Choice:
    """The next batch of the non-empty, arrival-ordered `pending` at time `now` (time.monotonic()): built around
    `seed`'s input, `window`'s inputs, due when full, when its seed has waited max_wait_ms, or when draining."""
    around, newcomers = seed(pending, oldest_next)
    waited = now - around.enqueued
    batch = window(pending, around, limits, newcomers)
    longest, total = max(it.length for it in batch), sum(it.length for it in batch)
    full = len(batch) >= limits.max_batch_requests or \
        total + longest > limits.max_batch_tokens or \
        len(batch) < len(pending)
    due = full or waited * 1e3 >= limits.max_wait_ms or draining
    return Choice(batch, newcomers, due, limits.max_wait_ms / 1e3 - waited)
