"""overlap_batches: the worker launches the next batch before it waits for the last one. On the GPU a launch is a
graph replay whose result arrives later; here the tiny model's real result is computed at launch and handed out
behind a stand-in for the CUDA event, so the worker's ordering, delivery and failure handling run on the CPU."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from fusedserve.model.api import LoadOptions, Rows
from fusedserve.model.runner import Embedder, Pending
from fusedserve.model.served import Served
from fusedserve.server import batcher as batcher_module
from fusedserve.server.batcher import Batcher
from fusedserve.server.config import Settings
from fusedserve.server.metrics import Metrics
from tests.tolerances import assert_embeddings_close


class SlowEvent:
    """Not done until waited on (a GPU forward still running); records the wait, may fail it."""

    def __init__(self, log: list, name: str, fail: bool = False) -> None:
        self.log, self.name, self.fail = log, name, fail

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        self.log.append(("wait", self.name))
        if self.fail:
            raise RuntimeError("device error while waiting")


@pytest.fixture(scope="module")
def embedder():
    e, _ = Embedder.load("tiny", device="cpu")
    return e


def _run(embedder, monkeypatch, overlap: bool, fail_first: bool = False):
    log: list = []
    launch = embedder.launch_ids

    def launch_later(ids, **kw):
        name = f"batch{sum(1 for entry in log if entry[0] == 'launch')}"
        log.append(("launch", name))
        result = launch(ids, **kw).wait()
        return Pending(result, SlowEvent(log, name, fail=fail_first and name == "batch0"))

    monkeypatch.setattr(embedder, "launch_ids", launch_later)
    settings = Settings(model="tiny", device="cpu", max_batch_requests=1, overlap_batches=overlap,
                        kernel_timing_sample_rate=0)
    batcher = Batcher(Served(embedder, None, LoadOptions()), settings, Metrics().for_model("tiny"))
    rows = [[101, 7592 + i, 2088 + 3 * i, 102] for i in range(3)]

    async def main():
        jobs = [batcher.submit(Rows.of([row]), timeout_s=30) for row in rows]  # queued before the worker
        batcher.start()
        return [await asyncio.wait_for(job.future, 30) for job in jobs]

    results = asyncio.run(main())
    assert batcher.drain(5)
    monkeypatch.undo()
    for row, got in zip(rows, results):  # each request gets its own rows' embeddings
        assert_embeddings_close(got[0], embedder.embed_ids([row], normalize=False)[0])
    assert not np.allclose(results[0], results[1])
    return log, batcher


def test_next_batch_is_launched_before_the_last_is_waited_for(embedder, monkeypatch):
    log, batcher = _run(embedder, monkeypatch, overlap=True)
    assert log.index(("launch", "batch1")) < log.index(("wait", "batch0"))
    assert [e for e in log if e[0] == "wait"] == [("wait", "batch0"), ("wait", "batch1"), ("wait", "batch2")]
    assert batcher.batches == 3 and batcher.overlapped == 2


def test_a_launched_batch_that_fails_runs_again_synchronously(embedder, monkeypatch):
    log, batcher = _run(embedder, monkeypatch, overlap=True, fail_first=True)
    # batch0's wait raised: it ran again (launch batch3) and was answered correctly all the same (checked in _run)
    assert ("wait", "batch0") in log and ("launch", "batch3") in log and batcher.batches == 3


def test_overlap_off_waits_for_each_batch_before_the_next(embedder, monkeypatch):
    log, batcher = _run(embedder, monkeypatch, overlap=False)
    assert batcher.overlapped == 0
    assert log == [(step, f"batch{i}") for i in range(3) for step in ("launch", "wait")]


def test_eager_results_are_delivered_at_once(embedder):
    pending = embedder.launch_ids([[101, 7592, 102]])
    assert pending.ready()  # nothing in flight on the CPU: the worker never holds such a batch back


def test_idle_work_waits_for_the_queue_and_is_refused_after_the_drain(embedder, monkeypatch):
    """when_idle (the graph captures after ready) runs only when nothing is queued or in flight, and after a
    drain it is refused at once (its waiter returns)."""
    from fusedserve.server.errors import Unavailable

    order: list = []
    launch = embedder.launch_ids

    idle_started: list[float] = []
    batch_ended: list[float] = []

    def recorded(ids, **kw):
        order.append("batch")
        pending = launch(ids, **kw)
        batch_ended.append(time.monotonic())  # eager on the CPU: done when launched
        return pending

    monkeypatch.setattr(embedder, "launch_ids", recorded)
    batcher = Batcher(Served(embedder, None, LoadOptions()), Settings(model="tiny", device="cpu", kernel_timing_sample_rate=0),
                      Metrics().for_model("tiny"))
    rows = [[101, 7592 + i, 102] for i in range(3)]

    async def main():
        jobs = [batcher.submit(Rows.of([row]), timeout_s=30) for row in rows]  # queued first
        idle = batcher.when_idle(lambda: idle_started.append(time.monotonic()) or order.append("idle") or "done")
        batcher.start()
        for job in jobs:
            await asyncio.wait_for(job.future, 30)
        return await asyncio.wait_for(asyncio.wrap_future(idle), 30)

    assert asyncio.run(main()) == "done"
    assert order[-1] == "idle" and order.count("batch") >= 1  # after every queued batch
    # and only after a pause as long as a client's back-to-back requests never leave (a lower bound: load only
    # makes it later)
    assert idle_started[0] - batch_ended[-1] >= batcher_module.IDLE_PAUSE_S * 0.99
    assert batcher.drain(5)
    with pytest.raises(Unavailable):
        batcher.when_idle(lambda: "too late").result(timeout=5)


def _record_timing(embedder, monkeypatch, events: list) -> None:
    """Record ("launch", first row's length) per launch_ids and ("step", ...) per block of a timed re-run."""
    launch, timed_steps = embedder.launch_ids, embedder.timed_steps

    def recorded_launch(ids, **kw):
        events.append(("launch", int(ids.lengths[0])))
        return launch(ids, **kw)

    class RecordedSteps:
        def __init__(self, ids, callback):
            self.steps, self.length = timed_steps(ids, callback), int(ids.lengths[0])

        def __iter__(self):
            return self

        def __next__(self):
            events.append(("step", self.length))
            return next(self.steps)

    monkeypatch.setattr(embedder, "launch_ids", recorded_launch)
    monkeypatch.setattr(embedder, "timed_steps", RecordedSteps)


def _kernel_counts(metrics) -> dict[str, float]:
    return {s.labels["op"]: s.value for family in metrics.kernel_duration.family.collect() for s in family.samples
            if s.name.endswith("_count")}


def test_a_sampled_batch_is_answered_first_and_timed_when_the_worker_is_idle(embedder, monkeypatch):
    """kernel_timing_sample_rate: the sampled request is served on the normal path (launch_ids, the graph replay on
    a GPU); its inputs run again through ServedModel.time_ops (Embedder.timed_steps) only after the answer, once the worker is idle, one
    sample at a time, one block per step (the embeddings, each layer, the head)."""
    events: list = []
    _record_timing(embedder, monkeypatch, events)
    # the loop records each answer before the worker's idle pause ends, even on a stalled machine
    monkeypatch.setattr(batcher_module, "IDLE_PAUSE_S", 0.5)
    metrics = Metrics().for_model("tiny")
    batcher = Batcher(Served(embedder, None, LoadOptions()), Settings(model="tiny", device="cpu", kernel_timing_sample_rate=1), metrics)
    rows = [[101, 7592 + i, 2088, 102][: 2 + i] for i in range(3)]  # lengths 2, 3, 4: which batch ran is visible

    async def main():
        batcher.start()
        answered = []
        for row in rows:  # back to back: no pause between them for a timing to take
            answered.append(await asyncio.wait_for(batcher.submit(Rows.of([row]), 30).future, 30))
            events.append(("answered", len(row)))
        idle = batcher.when_idle(lambda: "idle")  # after the waiting sample
        return answered, await asyncio.wait_for(asyncio.wrap_future(idle), 30)

    answered, idle = asyncio.run(main())
    assert idle == "idle" and len(answered) == 3
    first = events.index(("answered", 2))
    assert events[:first] == [("launch", 2)]  # the sampled request ran untimed and was answered first
    steps = [i for i, e in enumerate(events) if e[0] == "step"]
    assert steps and steps[0] > first and events[steps[0]] == ("step", 2)
    # each timing re-runs an answered request's inputs (requests arriving while a sample waits are not sampled; a
    # slow loop may leave a pause between them, so how many were is not fixed): the embeddings, each layer, the head
    blocks = embedder.config.num_layers + 2
    timed = [e[1] for e in events if e[0] == "step"]
    assert len(timed) % blocks == 0, events
    samples = [timed[i] for i in range(0, len(timed), blocks)]
    assert all(timed[i: i + blocks] == [length] * blocks for i, length in zip(range(0, len(timed), blocks), samples))
    for i in steps:
        assert ("answered", events[i][1]) in events[:i]
    assert _kernel_counts(metrics).get("embedding_layer_norm") == len(samples), events
    assert batcher.drain(5)


def test_under_traffic_that_never_pauses_a_sample_is_timed_a_block_between_two_batches(embedder, monkeypatch):
    """A waiting sample starts between two batches once overdue; from then on, one block runs between two batches
    while requests wait, and the rest at once when none does: no request waits for more than one block."""
    monkeypatch.setattr(batcher_module, "IDLE_PAUSE_S", 3600.0)  # never idle
    monkeypatch.setattr(batcher_module, "TIMING_OVERDUE_S", 0.0)  # overdue as soon as the next batch waits
    events: list = []
    _record_timing(embedder, monkeypatch, events)
    metrics = Metrics().for_model("tiny")
    batcher = Batcher(Served(embedder, None, LoadOptions()), Settings(model="tiny", device="cpu", kernel_timing_sample_rate=1), metrics)
    rows = [[101, 7592, 2088, 102][: 2 + i] for i in range(3)]

    async def main():
        batcher.start()
        first = batcher.submit(Rows.of([rows[0]]), 30)
        await asyncio.wait_for(first.future, 30)
        # two requests waiting together: the worker takes one block of the first sample between their batches
        jobs = [batcher.submit(Rows.of([row]), 30) for row in rows[1:]]
        await asyncio.wait_for(asyncio.gather(*(job.future for job in jobs)), 30)
        deadline = time.monotonic() + 30
        while _kernel_counts(metrics).get("embedding_layer_norm") is None:  # the rest of the sample, never idle
            assert time.monotonic() < deadline, events
            await asyncio.sleep(0.01)

    asyncio.run(main())
    launches = [i for i, e in enumerate(events) if e[0] == "launch"]
    assert events[launches[0]] == ("launch", 2) and events[launches[0] + 1] == ("step", 2), events
    for a, b in zip(launches, launches[1:]):  # never more than one block between two batches while they wait
        assert sum(e[0] == "step" for e in events[a:b]) <= 1, events
    assert sum(e == ("step", 2) for e in events) == embedder.config.num_layers + 2, events
    assert batcher.drain(5)


def test_work_between_batches_that_holds_up_waiting_inputs_is_logged(embedder, caplog):
    """Work on the worker between batches (a capture, a timing block, a backend switch) that took SLOW_WORK_S or more
    while inputs came to wait gets a warning naming it, once per SLOW_WORK_LOG_S for each kind of work; slow work
    nobody waited for does not."""
    batcher = Batcher(Served(embedder, None, LoadOptions()), Settings(model="tiny", device="cpu", kernel_timing_sample_rate=0),
                      Metrics().for_model("tiny"))
    started, submitted = threading.Event(), threading.Event()

    def slow_capture():
        started.set()
        assert submitted.wait(30)
        time.sleep(batcher_module.SLOW_WORK_S)  # slow work, the behaviour under test

    async def main():
        batcher.start()
        # slow work that no input waited for: no warning (the sleep is the slow work under test)
        await asyncio.wrap_future(batcher.between_batches(lambda: time.sleep(batcher_module.SLOW_WORK_S * 2)))
        for _ in range(2):  # the same work twice, a request arriving during each
            started.clear(), submitted.clear()
            work = batcher.between_batches(slow_capture)
            await asyncio.to_thread(started.wait, 30)
            job = batcher.submit(Rows.of([[101, 7592, 102]]), 30)  # queued when submit returns
            submitted.set()
            await asyncio.wrap_future(work)
            await asyncio.wait_for(job.future, 30)

    with caplog.at_level("WARNING", logger="fusedserve"):
        asyncio.run(main())
    held = [r.getMessage() for r in caplog.records if "between batches ended" in r.getMessage()]
    assert len(held) == 1, held
    assert held[0].startswith("1 inputs of tiny were waiting when") and "slow_capture" in held[0], held
    assert batcher.drain(5)


def _first_block_waits(embedder, monkeypatch, then_s: float = 0.0) -> tuple[threading.Event, threading.Event]:
    """Make the first block of the embedder's next timed sample set `blocking`, wait for `arrived`, then take
    `then_s` more seconds; returns (blocking, arrived)."""
    blocking, arrived = threading.Event(), threading.Event()
    steps_of = embedder.timed_steps

    class FirstBlockWaits:
        def __init__(self, ids, callback):
            self.steps, self.first = steps_of(ids, callback), True

        def __iter__(self):
            return self

        def __next__(self):
            if self.first:
                self.first = False
                blocking.set()
                assert arrived.wait(30)
                time.sleep(then_s)  # a slow block, where a test asks for one
            return next(self.steps)

    monkeypatch.setattr(embedder, "timed_steps", FirstBlockWaits)
    return blocking, arrived


def test_a_sample_started_while_idle_lets_the_next_batch_go_before_its_next_block(embedder, monkeypatch):
    """A request that arrives during the first block of a sample the idle worker started waits for that block only:
    its batch goes before the sample's next block."""
    monkeypatch.setattr(batcher_module, "IDLE_PAUSE_S", 0.01)
    events: list = []
    _record_timing(embedder, monkeypatch, events)
    blocking, arrived = _first_block_waits(embedder, monkeypatch)  # over the recording wrapper
    metrics = Metrics().for_model("tiny")
    batcher = Batcher(Served(embedder, None, LoadOptions()), Settings(model="tiny", device="cpu", kernel_timing_sample_rate=1), metrics)

    async def main():
        batcher.start()
        await asyncio.wait_for(batcher.submit(Rows.of([[101, 7592, 102]]), 30).future, 30)
        await asyncio.to_thread(blocking.wait, 30)  # the idle worker is in the sample's first block
        job = batcher.submit(Rows.of([[101, 7592, 2088, 102]]), 30)
        arrived.set()
        await asyncio.wait_for(job.future, 30)

    asyncio.run(main())
    second = events.index(("launch", 4))
    assert [e for e in events[:second] if e[0] == "step"] == [("step", 3)], events
    assert batcher.drain(5)


def test_a_slow_timing_block_is_logged_with_its_place_in_the_sample(embedder, monkeypatch, caplog):
    """The slow-work warning for a kernel-timing block says which block of which sample it was."""
    monkeypatch.setattr(batcher_module, "IDLE_PAUSE_S", 0.01)
    blocking, arrived = _first_block_waits(embedder, monkeypatch, then_s=batcher_module.SLOW_WORK_S)
    batcher = Batcher(Served(embedder, None, LoadOptions()), Settings(model="tiny", device="cpu", kernel_timing_sample_rate=1),
                      Metrics().for_model("tiny"))

    async def main():
        batcher.start()
        await asyncio.wait_for(batcher.submit(Rows.of([[101, 7592, 102]]), 30).future, 30)
        await asyncio.to_thread(blocking.wait, 30)  # the idle worker is in the sample's first block
        job = batcher.submit(Rows.of([[101, 7592, 2088, 102]]), 30)  # queued when submit returns: before the block ends
        arrived.set()
        await asyncio.wait_for(job.future, 30)

    with caplog.at_level("WARNING", logger="fusedserve"):
        asyncio.run(main())
    held = [r.getMessage() for r in caplog.records if "between batches ended" in r.getMessage()]
    assert len(held) == 1 and "Batcher._time_step (block 1 of a sampled batch of 1 inputs, 3 tokens)" in held[0], held
    assert batcher.drain(5)
