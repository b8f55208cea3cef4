"""The batch policy (server.batch_policy) on plain data: no model, thread or clock. Which inputs form the next batch
(the seed, the window of similar lengths, the token and input budgets, a newcomer's turn every other batch) and when
it is due (full, waited max_wait_ms, draining)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from fusedserve.server.batch_policy import Limits, next_batch, seed, window


@dataclass(eq=False)
class Request:
    started: float | None = None  # when its first batch started; None: a newcomer


@dataclass(eq=False)
class Input:
    length: int
    enqueued: float
    job: Request


def queue(lengths: list[int], started: float | None = None, first: float = 0.0) -> list[Input]:
    """One request's inputs in arrival order, one second apart from `first`."""
    job = Request(started)
    return [Input(n, first + i, job) for i, n in enumerate(lengths)]


def limits(tokens: int = 2048, requests: int = 64, wait_ms: float = 0.0) -> Limits:
    return Limits(max_batch_tokens=tokens, max_batch_requests=requests, max_wait_ms=wait_ms)


def test_the_seed_is_the_oldest_unless_a_newcomer_waits_behind_a_request_that_has_run():
    started = queue([100] * 3, started=0.0)
    [fresh] = queue([10], first=10.0)
    assert seed(started, oldest_next=False) == (started[0], False)  # no newcomer waits
    assert seed([*started, fresh], oldest_next=False) == (fresh, True)  # the newcomer's turn
    assert seed([*started, fresh], oldest_next=True) == (started[0], False)  # the turn after it: the oldest's
    waiting = queue([5, 7])
    assert seed(waiting, oldest_next=False) == (waiting[0], False)  # the oldest is a newcomer itself


def test_the_budget_counts_real_tokens():
    # 100 + 3 x 10 = 130 fits a budget of 130, a fourth 10 does not (padded, two rows would already cost 2 x 100)
    items = queue([100, 10, 10, 10, 10])
    batch = window(items, items[0], limits(tokens=130))
    assert items[0] in batch and len(batch) == 4


def test_the_window_takes_the_closer_length_and_the_shorter_on_ties():
    items = queue([20, 5, 19, 21, 40])
    assert [it.length for it in window(items, items[0], limits(tokens=60))] == [19, 20, 21]
    items = queue([20, 18, 22])
    assert [it.length for it in window(items, items[0], limits(tokens=38))] == [18, 20]  # 18 and 22 tie: 18


def test_the_window_holds_at_most_max_batch_requests_the_oldest_of_each_length_first():
    items = queue([50] * 41)
    assert window(items, items[0], limits(tokens=10**6, requests=10)) == items[:10]


def test_an_input_longer_than_the_budget_runs_alone():
    items = queue([5000, 10, 10])
    assert window(items, items[0], limits(tokens=2048)) == [items[0]]


def test_a_newcomers_window_holds_newcomers_only():
    started = queue([10] * 5, started=0.0)
    fresh = [*queue([10], first=10.0), *queue([12], first=11.0)]
    assert window([*started, *fresh], fresh[0], limits(), newcomers=True) == fresh


def test_a_batch_is_due_when_full_waited_or_draining_else_it_waits_for_the_rest_of_max_wait_ms():
    items = queue([10, 10])
    waiting = next_batch(items, limits(wait_ms=5.0), now=0.002)  # the oldest came at 0: waited 2 ms of 5
    assert not waiting.due and waiting.batch == items and abs(waiting.wait_s - 0.003) < 1e-9
    assert next_batch(items, limits(wait_ms=5.0), now=0.005).due  # waited max_wait_ms
    assert next_batch(items, limits(wait_ms=5.0), now=0.002, draining=True).due
    assert next_batch(items, limits(wait_ms=0.0), now=0.0).due  # max_wait_ms 0: the worker takes what is queued
    assert next_batch(items, limits(requests=2, wait_ms=5.0), now=0.002).due  # max_batch_requests inputs
    assert next_batch(items, limits(tokens=29, wait_ms=5.0), now=0.002).due  # another 10 would pass 29 tokens
    assert not next_batch(items, limits(tokens=30, wait_ms=5.0), now=0.002).due
    left_out = next_batch(queue([10, 10, 500]), limits(tokens=100, wait_ms=5.0), now=0.002)
    assert left_out.due and len(left_out.batch) == 2  # an input was left out: waiting adds nothing


def test_newcomers_and_the_large_request_take_turns():
    """A request of 300 long inputs whose first batch has run, and one-input requests arriving: the batches go to
    the newcomers and the large request alternately, a newcomer's batch holding newcomers only."""
    pending = queue([100] * 300, started=0.0)
    oldest_next, turns = False, []
    for arrival in range(4):
        pending += queue([10], first=1000.0 + arrival)
        choice = next_batch(pending, limits(), now=2000.0, oldest_next=oldest_next)
        assert choice.due
        turns.append("newcomer" if choice.newcomers else "large")
        assert all(it.job.started is None for it in choice.batch) == choice.newcomers
        for it in choice.batch:  # taken: its request has run
            pending.remove(it)
            it.job.started = 2000.0
        oldest_next = choice.newcomers
        choice = next_batch(pending, limits(), now=2000.0, oldest_next=oldest_next)
        turns.append("newcomer" if choice.newcomers else "large")
        for it in choice.batch:
            pending.remove(it)
        oldest_next = choice.newcomers
    assert turns == ["newcomer", "large"] * 4


def test_every_batch_holds_its_seed_and_is_a_run_of_similar_lengths_within_the_budgets():
    rng = random.Random(11)
    for _ in range(20):
        pending = queue([rng.randint(1, 300) for _ in range(rng.randint(1, 400))])
        budget = limits(tokens=rng.choice([256, 1024, 4096]), requests=rng.choice([8, 64]))
        while pending:
            choice = next_batch(pending, budget, now=1e9)
            ordered = sorted(pending, key=lambda it: (it.length, it.enqueued))
            start = ordered.index(choice.batch[0])
            assert choice.due and pending[0] in choice.batch
            assert ordered[start : start + len(choice.batch)] == choice.batch
            assert len(choice.batch) <= budget.max_batch_requests
            assert len(choice.batch) == 1 or sum(it.length for it in choice.batch) <= budget.max_batch_tokens
            pending = [it for it in pending if it not in choice.batch]
