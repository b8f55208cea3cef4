"""The dynamic batcher: one worker thread owns the model and the device. Handlers validate, prepare, submit
and await a future; they never touch tensors. The batcher is also the model's Worker (fusedserve.model.api): the
model's own device work (warm-up, graph captures, switches) runs on the same thread, between batches or when idle.

Which waiting inputs form the next batch, and when it is due, is server.batch_policy's: a batch closes when its real
tokens would pass `max_batch_tokens` (the models run batches packed, so the GEMMs and fused ops see no padding), when
it holds `max_batch_requests` inputs, or when its oldest input has waited `max_wait_ms`; it is the window of similar
lengths around the oldest waiting input (so nothing starves). A request's inputs are separate items: they may land in
different batches; each batch's output rows come back as one block (BatchRunner), and each request's rows are copied
into its own block in one step per batch. Expired inputs are answered 504 and cancelled ones dropped before they run.

With CUDA graphs (overlap_batches) the worker launches a batch and, if another is due, launches that one too
before it waits for the first: the device is never idle while the worker delivers results or waits for the GIL.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from fusedserve.model.api import OutOfDeviceMemory, Pending, Rows, ServedModel
from fusedserve.server import batch_policy
from fusedserve.server.config import Settings
from fusedserve.server.deadline import not_served
from fusedserve.server.errors import Overloaded, ServiceError, Unavailable
from fusedserve.server.metrics import ModelMetrics
from fusedserve.server.observability import Throttle
from fusedserve.server.quantize import shape

log = logging.getLogger("fusedserve.batcher")


# when_idle's pause: longer than a client's turnaround between back-to-back requests (a loopback round trip and
# its own work, well under a millisecond to a few), short enough that the work runs soon after traffic stops
IDLE_PAUSE_S = 0.05
# A sampled batch's per-op timing (kernel_timing_sample_rate) re-runs its inputs eagerly once the batch is answered,
# one block of the forward at a time (Embedder.timed_steps): it starts at the next idle moment, or between two batches
# once it has waited this long under traffic that never pauses; once started, a block runs between two batches while
# traffic lasts and the next at once when none waits. A request arriving meanwhile waits for one block at most.
TIMING_OVERDUE_S = 1.0
# work between batches (a timing block, a graph capture, a backend switch) this long while inputs wait is logged,
# at most once per SLOW_WORK_LOG_S for each kind of work
SLOW_WORK_S = 0.05
SLOW_WORK_LOG_S = 60.0


@dataclass
class _Sample:
    """A sampled batch waiting for its per-op timing, or part-way through it."""
    rows: Rows
    taken: float  # time.monotonic() when it was sampled
    steps: Iterator[None] | None = None  # the timed forward, once started
    blocks: int = 0  # blocks started so far

    def describe(self) -> str:
        """Which block of which batch: the slow-work warning's detail."""
        return f"block {self.blocks} of a sampled batch of {len(self.rows)} inputs, {self.rows.tokens} tokens"

    def due(self, waiting: bool, stepped: bool) -> bool:
        """Whether its next block runs now, between batches (`waiting`: inputs wait; `stepped`: a block ran since
        the last batch was taken). A started sample: its next block at once when no input waits, else one between two
        batches; one not started yet: between two batches once overdue, else at the next idle moment (the batcher's
        idle work)."""
        started = self.steps is not None
        overdue = time.monotonic() - self.taken >= TIMING_OVERDUE_S
        return (started and not waiting) or (waiting and not stepped and (started or overdue))

    def step(self, model: ServedModel, record: Callable[[str, str, float], None]) -> bool:
        """Run its next block, every op timed into `record` once the last block has run; True when no block is left.
        Only instrumentation: a failure is logged and ends the sample, and the answer (already delivered) stands."""
        try:
            if self.steps is None:
                self.steps = model.time_ops(self.rows, record)
            self.blocks += 1
            next(self.steps)
            return False  # more blocks to go
        except StopIteration:
            pass
        except Exception as exc:
            log.warning("timing the ops of a sampled batch of %d inputs failed (%s: %s)", len(self.rows),
                        type(exc).__name__, exc)
        return True


@dataclass(eq=False)
class Job:
    """One client request: its inputs' token ids and where their output rows go.

    One writer per field: `cancelled` is written by the event loop (Batcher.cancel) under the batcher's lock;
    `result`, `remaining` and `finished` by the worker thread alone (deliver, fail); the future is resolved on
    the job's event loop (call_soon_threadsafe)."""

    rows: Rows
    deadline: float
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    normalize: bool = False  # how the request's rows are shaped on delivery (quantize.shape)
    dimensions: int | None = None
    result: np.ndarray | None = None  # [n, width] float32, filled batch by batch
    remaining: int = 0
    cancelled: bool = False
    finished: bool = False
    # time.monotonic() stamps for the request's timing headers and spans: submitted (submit), its first batch
    # started (the worker), its last row delivered (the worker)
    enqueued: float = 0.0
    started: float | None = None
    done: float | None = None

    def __post_init__(self) -> None:
        self.remaining = len(self.rows)

    def _settle(self, value=None, error: BaseException | None = None) -> None:
        if self.finished:
            return
        self.finished = True

        def apply() -> None:
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(value)

        self.loop.call_soon_threadsafe(apply)

    def fail(self, error: BaseException) -> None:
        self._settle(error=error)

    def deliver(self, indices: list[int], rows: np.ndarray) -> None:
        """This request's inputs `indices` got `rows` (one row each, in that order)."""
        if self.result is None and len(indices) == len(self.rows) and indices == sorted(indices):
            self.remaining = 0  # every row in one batch, in order (a one-text request): the rows are the answer
            self.done = time.monotonic()
            self._settle(rows)
            return
        if self.result is None:
            self.result = np.empty((len(self.rows), rows.shape[1]), dtype=np.float32)
        self.result[indices] = rows
        self.remaining -= len(indices)
        if self.remaining == 0:
            self.done = time.monotonic()
            self._settle(self.result)


@dataclass(eq=False)
class Item:
    """One input of a job waiting in the queue (what server.batch_policy chooses among)."""

    job: Job
    index: int
    length: int
    enqueued: float


class Batcher:
    """One model's queue of inputs and the worker thread that serves it: batches (server.batch_policy chooses them,
    BatchRunner runs them), and the model's own work between batches or when idle."""

    def __init__(self, model: ServedModel, settings: Settings, metrics: ModelMetrics,
                 on_batch: Callable[[Rows, np.ndarray], None] | None = None) -> None:
        """metrics: the model's own series (Metrics.for_model); one batcher per model."""
        self.model, self.settings, self.metrics = model, settings, metrics
        self._limits = batch_policy.Limits.of(settings)
        # sampled batches go to the verifier through on_batch; sampled for op timing, to _sample_timing
        self._runner = BatchRunner(model, settings, metrics, on_batch, self._sample_timing)
        self._pending: list[Item] = []
        self._cond = threading.Condition()
        self._control: list[tuple[Callable[[], object], concurrent.futures.Future]] = []
        self._idle_work: list[tuple[Callable[[], object], concurrent.futures.Future]] = []  # when_idle
        self._timing: _Sample | None = None
        self._stepped = False  # a block of the sample ran since the last batch was taken
        self._oldest_next = False  # the last batch was built around a newcomer (batch_policy.seed)
        self._slow_work = Throttle(SLOW_WORK_LOG_S)  # _note_wait: one warning per kind of work per interval
        self._stopping = False
        self._draining = False
        self._busy = False
        self._last_activity = 0.0  # the latest submit or batch end (when_idle waits for a pause after it)
        self._thread = threading.Thread(target=self._run, name=f"fusedserve-batcher[{metrics.model}]", daemon=True)
        self.overlapped = 0  # batches launched while the one before was still in flight (overlap_batches)

    # ---- called from the event loop ---------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def batches(self) -> int:
        """Batches answered so far."""
        return self._runner.batches

    def submit(self, rows: Rows, timeout_s: float, *, normalize: bool = False, dimensions: int | None = None) -> Job:
        """Queue a request's rows; its job's future resolves to their output rows [len(rows), width] float32, in
        order (the first `dimensions` of each, L2-normalized where asked: quantize.shape), or to the error that
        stopped them."""
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        job = Job(rows, now + timeout_s, loop.create_future(), loop, normalize, dimensions)
        with self._cond:
            if self._draining or self._stopping:
                self.metrics.rejected.labels("draining").inc()
                raise Unavailable("the server is shutting down", headers={"Retry-After": "1"})
            if len(self._pending) + len(rows) > self.settings.max_queue:
                self.metrics.rejected.labels("queue_full").inc()
                raise Overloaded(f"queue full ({len(self._pending)} inputs waiting); retry later",
                                 headers={"Retry-After": "1"})
            # stamped under the lock: _pending stays in arrival order (the oldest first; batch_policy relies on it)
            now = job.enqueued = self._last_activity = time.monotonic()
            self._pending.extend(Item(job, i, length, now) for i, length in enumerate(rows.lengths.tolist()))
            self.metrics.queue_depth.set(len(self._pending))
            self._cond.notify()
        return job

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        """The client went away or gave up: drop its inputs that have not run yet."""
        with self._cond:
            if job.finished or job.cancelled:
                return
            job.cancelled = True
            self.metrics.rejected.labels(reason).inc()

    def between_batches(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run `fn` on the worker thread between two batches (backend switches must not race a forward)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stopping or not self._thread.is_alive() and self._thread.ident is not None:
                future.set_exception(Unavailable("the server is shutting down", headers={"Retry-After": "1"}))
                return future
            self._control.append((fn, future))
            self._cond.notify()
        return future

    def when_idle(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run `fn` on the worker thread when no input is waiting, no batch is in flight and none has come or ended
        for IDLE_PAUSE_S (background work, such as capturing the rest of the CUDA graphs after ready). The pause keeps
        it out of a client's back-to-back requests, whose gaps are a round trip long: a request arriving meanwhile
        waits for this one call at most."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stopping or self._draining:
                future.set_exception(Unavailable("the server is shutting down", headers={"Retry-After": "1"}))
                return future
            self._idle_work.append((fn, future))
            self._cond.notify()
        return future

    def drain(self, timeout_s: float) -> bool:
        """Refuse new work, finish everything accepted, then stop the worker. True if all finished."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._draining = True
            while (self._pending or self._busy) and time.monotonic() < deadline:
                self._cond.wait(timeout=0.05)
            drained = not self._pending and not self._busy
            self._stopping = True
            self._timing = None  # a sample not timed yet, or part-way (its suspended forward is dropped)
            for _, future in self._idle_work:  # background work never started: its caller stops waiting
                future.set_exception(Unavailable("the server is shutting down", headers={"Retry-After": "1"}))
            self._idle_work.clear()
            self._cond.notify_all()
        self._thread.join(timeout=max(deadline - time.monotonic(), 0.1))
        return drained

    # ---- the worker thread ------------------------------------------------------------------------
    def _run(self) -> None:
        """Take a batch, launch it, then finish the batch launched before it (overlap_batches): the device runs
        one batch while this thread delivers the previous one and waits for the GIL, which a busy event loop
        holds for up to a switch interval each time this thread comes back from waiting on the device."""
        inflight: InFlight | None = None
        while True:
            with self._cond:
                batch = self._next_batch(block=inflight is None)
                if batch is None:
                    break
                self._busy = True
                control, self._control = self._control, []
            if control and inflight is not None:  # control work runs between batches, never beside one
                self._runner.finish(inflight)
                inflight = None
            for fn, future in control:
                # a future its caller cancelled (a request gone, a deadline passed) is skipped: settling a cancelled
                # future raises, and on this thread that would end the worker
                if not future.set_running_or_notify_cancel():
                    continue
                started = time.perf_counter()
                try:
                    future.set_result(fn())
                except Exception as exc:  # reported to whoever asked
                    future.set_exception(exc)
                self._note_wait(fn, time.perf_counter() - started)
            launched = self._runner.start(batch) if batch else None
            worked = bool(batch) or inflight is not None
            if inflight is not None:
                self.overlapped += launched is not None
                self._runner.finish(inflight)
            inflight = launched
            with self._cond:
                self._busy = inflight is not None
                if worked:
                    self._last_activity = time.monotonic()
                self._cond.notify_all()
        if inflight is not None:
            self._runner.finish(inflight)

    def _next_batch(self, block: bool = True) -> list[Item] | None:
        """Under the lock: block until a batch is due (or control work or stop), then take it. With
        block=False, return [] at once when nothing is due (a launched batch is waiting to be finished). Which inputs
        form the batch, and when it is due, is server.batch_policy's."""
        while True:
            if self._control:
                return []
            self._drop_dead()
            if self._timing is not None and not self._draining and self._timing.due(bool(self._pending),
                                                                                     self._stepped):
                self._control.append(self._timing_work())
                return []
            if not self._pending:
                if self._stopping:
                    return None
                if not block:
                    return []
                if (self._idle_work or self._timing is not None) and not self._draining:  # none waiting or in flight
                    quiet = time.monotonic() - self._last_activity
                    if quiet >= IDLE_PAUSE_S:
                        self._control.append(self._timing_work() if self._timing is not None
                                             else self._idle_work.pop(0))
                        return []
                    self._cond.wait(timeout=IDLE_PAUSE_S - quiet)
                    continue
                self._cond.wait()
                continue
            choice = batch_policy.next_batch(self._pending, self._limits, now=time.monotonic(),
                                             oldest_next=self._oldest_next, draining=self._draining)
            if choice.due:
                self._stepped = False  # the next block of a sample may run after this batch
                self._oldest_next = choice.newcomers  # a newcomer's turn: the oldest's next
                taken = set(map(id, choice.batch))
                self._pending = [it for it in self._pending if id(it) not in taken]
                self.metrics.queue_depth.set(len(self._pending))
                return choice.batch
            if not block:
                return []
            self._cond.wait(timeout=choice.wait_s)

    def _timing_work(self) -> tuple[Callable[[], object], concurrent.futures.Future]:
        """Under the lock: the next block of the waiting sample's timing, as control work for the worker (nobody
        waits on its future). The next batch goes before another block."""
        self._stepped = True
        work = functools.partial(self._time_step, self._timing)
        work.describe = self._timing.describe  # the slow-work warning's detail (_note_wait)
        return work, concurrent.futures.Future()

    def _time_step(self, sample: _Sample) -> None:
        """One block of an answered batch's inputs again, eagerly, into the kernel-duration histogram; the sample is
        let go after its last."""
        if sample.step(self.model, self._record_kernel):
            with self._cond:
                if self._timing is sample:
                    self._timing = None

    def _sample_timing(self, rows: Rows) -> None:
        """Keep this batch's inputs to time its ops later (_time_step); one sample waits at a time, later ones are
        not taken meanwhile."""
        with self._cond:
            if self._timing is None and not self._draining:
                self._timing = _Sample(rows, time.monotonic())
                self._cond.notify()

    def _note_wait(self, fn: Callable[[], object], seconds: float) -> None:
        """A warning when work between batches took SLOW_WORK_S or longer and inputs were waiting when it ended (what
        a request's latency cannot show: which work it waited for), at most once per SLOW_WORK_LOG_S per kind of
        work (a sampled batch's timing blocks can each take that long on a CPU). Work with a `describe()` says more
        about itself in the line."""
        if seconds < SLOW_WORK_S or not self._pending:
            return
        name = getattr(getattr(fn, "func", fn), "__qualname__", repr(fn))
        if not self._slow_work.allow(name):
            return
        describe = getattr(fn, "describe", None)
        what = f"{name} ({describe()})" if describe is not None else name
        log.warning("%d inputs of %s were waiting when %s between batches ended; it took %.0f ms",
                    len(self._pending), self.metrics.model, what, seconds * 1e3)

    def _record_kernel(self, op: str, backend: str, seconds: float) -> None:
        self.metrics.kernel_duration.labels(op, backend).observe(seconds)

    def _drop_dead(self) -> None:
        now = time.monotonic()
        alive = []
        for it in self._pending:
            if it.job.cancelled or it.job.finished:
                continue
            if now >= it.job.deadline:
                self.metrics.rejected.labels("timeout").inc()
                it.job.fail(not_served(self.settings.request_timeout_s))
                continue
            alive.append(it)
        self._pending = alive


class BatchRunner:
    """A batch's forward and delivery, on the worker thread: launched (overlap_batches) and finished once the next
    is launched, or run to the end at once; a fused forward that fails re-run on the reference path; a batch out of
    device memory split in halves; each request's rows copied into its own block."""

    def __init__(self, model: ServedModel, settings: Settings, metrics: ModelMetrics,
                 on_batch: Callable[[Rows, np.ndarray], None] | None, sample: Callable[[Rows], None]) -> None:
        """on_batch: a share of the answered batches (verify_sample_rate) go to the verifier; sample: a share of
        the batches (kernel_timing_sample_rate) go to the kernel timer."""
        self.model, self.settings, self.metrics = model, settings, metrics
        self.on_batch, self.sample = on_batch, sample
        self.batches = 0  # answered

    def start(self, batch: list[Item]) -> InFlight | None:
        """Launch `batch` and return it in flight, or run it to the end here (the kernel timer's sampled batches,
        overlap_batches off, or a launch that raised: the synchronous path retries, falls back, splits)."""
        m = self.metrics
        now = time.monotonic()
        for it in batch:
            m.queue_duration.observe(now - it.enqueued)
            if it.job.started is None:
                it.job.started = now
        rows = Rows.gather([(it.job.rows, it.index) for it in batch])
        longest, real = rows.longest, rows.tokens
        m.batch_size.observe(len(batch))
        m.batch_tokens.observe(longest * len(batch))
        m.batch_padding_ratio.observe(1 - real / (longest * len(batch)))
        m.device_tokens.inc(real)
        if random.random() < self.settings.kernel_timing_sample_rate:
            self.sample(rows)  # timed after it is answered: the request never waits on the instrumented path
        if self.settings.overlap_batches:
            started = time.perf_counter()
            try:
                pending = self.model.launch(rows)
            except Exception as exc:  # OOM or a failing kernel: the synchronous path below retries, falls back
                log.warning("launching a batch of %d inputs failed (%s: %s); running it on the synchronous path",
                            len(rows), type(exc).__name__, exc, exc_info=True)
            else:
                inflight = InFlight(batch, rows, pending, started)
                if not pending.ready():
                    return inflight
                self.finish(inflight)  # computed already (the eager paths): deliver now, do not hold it
                return None
        self._complete(batch, rows, lambda: self._forward(rows))
        return None

    def finish(self, inflight: InFlight) -> None:
        self._complete(inflight.batch, inflight.rows, lambda: self._collect(inflight))

    def _collect(self, inflight: InFlight) -> np.ndarray:
        """The result of a launched batch; one that raised or came back non-finite runs again synchronously
        (which retries it and falls back to the reference path as an unlaunched batch would)."""
        try:
            block = inflight.pending.rows()
            if not np.isfinite(block).all():
                raise NonFiniteOutput(f"{inflight.pending.path} forward produced NaN/Inf")
        except Exception as exc:
            log.warning("launched batch failed (%s: %s); running it again on the synchronous path",
                        type(exc).__name__, exc, exc_info=not isinstance(exc, NonFiniteOutput))
            return self._forward(inflight.rows)
        self.metrics.forward_duration.labels(inflight.pending.path).observe(time.perf_counter() - inflight.started)
        return block

    def _complete(self, batch: list[Item], rows: Rows, forward: Callable[[], np.ndarray]) -> None:
        """Run `forward` for the batch and deliver its block to the requests, each request's rows in one copy (or
        fail them all)."""
        try:
            block = forward()
        except OutOfDeviceMemory:
            log.error("out of memory even for a single input of %d tokens", rows.longest)
            for it in batch:
                it.job.fail(Unavailable("out of device memory for this input; retry later",
                                        headers={"Retry-After": "1"}))
            return
        except Exception as exc:
            log.exception("batch of %d inputs failed on both paths", len(batch))
            for it in batch:
                it.job.fail(ServiceError(f"inference failed ({type(exc).__name__})"))
            return
        by_job: dict[int, tuple[Job, list[int], list[int]]] = {}
        for position, it in enumerate(batch):
            _, positions, indices = by_job.setdefault(id(it.job), (it.job, [], []))
            positions.append(position)
            indices.append(it.index)
        shaped: dict[tuple[bool, int | None], np.ndarray] = {}  # once per batch and request shape, vectorized
        for job, positions, indices in by_job.values():
            key = (job.normalize, job.dimensions)
            if key not in shaped:
                shaped[key] = shape(block, normalize=job.normalize, dimensions=job.dimensions)
            out = shaped[key]
            job.deliver(indices, out[positions[0]: positions[0] + 1] if len(positions) == 1 else out[positions])
        self.batches += 1
        if self.on_batch is not None and random.random() < self.settings.verify_sample_rate:
            self.on_batch(rows, block)

    def _forward(self, rows: Rows) -> np.ndarray:
        """Raw output rows. A batch that runs out of device memory is split in halves and retried (a single input
        that still does not fit fails)."""
        try:
            return self._forward_once(rows)
        except OutOfDeviceMemory:
            if len(rows) == 1:
                raise
            log.warning("out of memory on a batch of %d inputs; splitting it in two", len(rows))
            self.metrics.batch_splits.inc()
            half = len(rows) // 2
            return np.concatenate([self._forward(rows.slice(0, half)), self._forward(rows.slice(half, len(rows)))])

    def _forward_once(self, rows: Rows) -> np.ndarray:
        """One forward on the current path. A fused forward that raises or yields NaN/Inf is re-run on the
        reference path (counted); non-finite output from the reference itself is an error, never an answer."""
        started = time.perf_counter()
        path = None
        try:
            pending = self.model.launch(rows)  # on an eager path the forward runs here, and may raise here
            path = pending.path
            block = pending.rows()
            if not np.isfinite(block).all():
                raise NonFiniteOutput(f"{path} forward produced NaN/Inf")
        except OutOfDeviceMemory:
            raise
        except Exception as exc:
            if path is None:  # the launch itself raised: the path it would have taken, as the model says now
                path = self.model.describe().path
            if path == "reference":
                raise
            reason = "non_finite" if isinstance(exc, NonFiniteOutput) else "exception"
            log.warning("fused forward failed (%s: %s); re-running the batch on the reference path",
                        type(exc).__name__, exc, exc_info=not isinstance(exc, NonFiniteOutput))
            self.metrics.fallbacks.labels("all", reason).inc()
            path = "reference"
            started = time.perf_counter()
            block = self.model.launch(rows, reference=True).rows()
            if not np.isfinite(block).all():
                raise NonFiniteOutput("reference forward produced NaN/Inf") from exc
        self.metrics.forward_duration.labels(path).observe(time.perf_counter() - started)
        return block


class NonFiniteOutput(RuntimeError):
    pass



@dataclass(eq=False)
class InFlight:
    """A launched batch the worker has not finished yet."""

    batch: list[Item]
    rows: Rows
    pending: Pending
    started: float
