"""The dynamic batcher: one worker thread owns the model and the device. Handlers validate, tokenize,
submit and await a future; they never touch tensors.

A batch closes when its token cost would pass `max_batch_tokens` (the real tokens with the packed layout, where
the GEMMs and fused ops see no padding; rows x longest row with the padded layout), when it holds
`max_batch_requests` inputs, or when its oldest input has waited `max_wait_ms`. Inputs are grouped by
length to cut padding: the batch is the window of similar lengths around the oldest waiting input (so
nothing starves). A request's inputs are separate items: they may land in different batches and are
reassembled in order. Expired inputs are answered 504 and cancelled ones dropped before they run.

With CUDA graphs (overlap_batches) the worker launches a batch and, if another is due, launches that one too
before it waits for the first: the device is never idle while the worker delivers results or waits for the GIL.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import functools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np
import torch

from fusedserve.model.runner import Embedder, Pending
from fusedserve.server.config import Settings
from fusedserve.server.errors import Overloaded, ServiceError, Timeout, Unavailable
from fusedserve.server.metrics import ModelMetrics
from fusedserve.server.observability import Throttle

log = logging.getLogger("fusedserve.batcher")

def l2_normalize(matrix: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm, as torch.nn.functional.normalize (norms floored at 1e-12)."""
    return matrix / np.maximum(np.linalg.norm(matrix, axis=1, keepdims=True), 1e-12)


# call_when_idle's pause: longer than a client's turnaround between back-to-back requests (a loopback round trip and
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
    ids: list[list[int]]
    taken: float  # time.monotonic() when it was sampled
    steps: Iterator[None] | None = None  # the timed forward, once started
    blocks: int = 0  # blocks started so far

    def describe(self) -> str:
        """Which block of which batch: the slow-work warning's detail."""
        return f"block {self.blocks} of a sampled batch of {len(self.ids)} inputs, {sum(map(len, self.ids))} tokens"


@dataclass(eq=False)
class Job:
    """One client request: its inputs' token ids and where their embeddings go.

    One writer per field: `cancelled` is written by the event loop (Batcher.cancel) under the batcher's lock;
    `results`, `remaining` and `finished` by the worker thread alone (deliver, fail); the future is resolved on
    the job's event loop (call_soon_threadsafe)."""

    ids: list[list[int]]
    normalize: bool
    deadline: float
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    results: list[np.ndarray | None] = field(default_factory=list)
    remaining: int = 0
    cancelled: bool = False
    finished: bool = False
    # time.monotonic() stamps for the request's timing headers and spans: submitted (submit), its first batch
    # started (the worker), its last row delivered (the worker)
    enqueued: float = 0.0
    started: float | None = None
    done: float | None = None

    def __post_init__(self) -> None:
        self.results = [None] * len(self.ids)
        self.remaining = len(self.ids)

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

    def deliver(self, index: int, row: np.ndarray) -> None:
        self.results[index] = row
        self.remaining -= 1
        if self.remaining == 0:
            self.done = time.monotonic()
            self._settle(np.stack(self.results))


@dataclass(eq=False)
class Item:
    job: Job
    index: int
    length: int
    enqueued: float


class Batcher:
    def __init__(self, embedder: Embedder, settings: Settings, metrics: ModelMetrics,
                 on_batch: Callable[[list[list[int]], torch.Tensor], None] | None = None) -> None:
        """metrics: the model's own series (Metrics.for_model); one batcher per model."""
        self.embedder, self.settings, self.metrics = embedder, settings, metrics
        self.on_batch = on_batch  # sampled batches go to the verifier through this
        self._pending: list[Item] = []
        self._cond = threading.Condition()
        self._control: list[tuple[Callable[[], object], concurrent.futures.Future]] = []
        self._idle_work: list[tuple[Callable[[], object], concurrent.futures.Future]] = []  # call_when_idle
        self._timing: _Sample | None = None
        self._stepped = False  # a block of the sample ran since the last batch was taken
        self._slow_work = Throttle(SLOW_WORK_LOG_S)  # _note_wait: one warning per kind of work per interval
        self._stopping = False
        self._draining = False
        self._busy = False
        self._last_activity = 0.0  # the latest submit or batch end (call_when_idle waits for a pause after it)
        self._thread = threading.Thread(target=self._run, name=f"fusedserve-batcher[{metrics.model}]", daemon=True)
        self.batches = 0
        self.overlapped = 0  # batches launched while the one before was still in flight (overlap_batches)
        self._packed = embedder.layout == "packed"

    def _cost(self, rows: int, longest: int, total: int) -> int:
        """What a batch costs against max_batch_tokens: its real tokens when packed, its padded block if not."""
        return total if self._packed else rows * longest

    # ---- called from the event loop ---------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    def submit(self, ids: list[list[int]], normalize: bool, timeout_s: float) -> Job:
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        job = Job(ids, normalize, now + timeout_s, loop.create_future(), loop)
        with self._cond:
            if self._draining or self._stopping:
                self.metrics.rejected.labels("draining").inc()
                raise Unavailable("the server is shutting down", headers={"Retry-After": "1"})
            if len(self._pending) + len(ids) > self.settings.max_queue:
                self.metrics.rejected.labels("queue_full").inc()
                raise Overloaded(f"queue full ({len(self._pending)} inputs waiting); retry later",
                                 headers={"Retry-After": "1"})
            # stamped under the lock: _pending stays in arrival order (the oldest first; _choose relies on it)
            now = job.enqueued = self._last_activity = time.monotonic()
            self._pending.extend(Item(job, i, len(row), now) for i, row in enumerate(ids))
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

    def call_between_batches(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run `fn` on the worker thread between two batches (backend switches must not race a forward)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stopping or not self._thread.is_alive() and self._thread.ident is not None:
                future.set_exception(Unavailable("the server is shutting down", headers={"Retry-After": "1"}))
                return future
            self._control.append((fn, future))
            self._cond.notify()
        return future

    def call_when_idle(self, fn: Callable[[], object]) -> concurrent.futures.Future:
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
                self._finish(inflight)
                inflight = None
            for fn, future in control:
                started = time.perf_counter()
                try:
                    future.set_result(fn())
                except Exception as exc:  # reported to whoever asked
                    future.set_exception(exc)
                self._note_wait(fn, time.perf_counter() - started)
            launched = self._start(batch) if batch else None
            worked = bool(batch) or inflight is not None
            if inflight is not None:
                self.overlapped += launched is not None
                self._finish(inflight)
            inflight = launched
            with self._cond:
                self._busy = inflight is not None
                if worked:
                    self._last_activity = time.monotonic()
                self._cond.notify_all()
        if inflight is not None:
            self._finish(inflight)

    def _next_batch(self, block: bool = True) -> list[Item] | None:
        """Under the lock: block until a batch is due (or control work or stop), then take it. With
        block=False, return [] at once when nothing is due (a launched batch is waiting to be finished)."""
        s = self.settings
        while True:
            if self._control:
                return []
            self._drop_dead()
            timing = self._timing if not self._draining else None
            if timing is not None:
                started = timing.steps is not None
                overdue = time.monotonic() - timing.taken >= TIMING_OVERDUE_S
                # a started sample: its next block at once when no input waits, else one between two batches; one
                # not started yet: between two batches once overdue, else at the next idle moment (below)
                if (started and not self._pending) or (self._pending and not self._stepped and (started or overdue)):
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
            oldest = self._pending[0]  # arrival order
            waited = time.monotonic() - oldest.enqueued
            batch = self._choose(oldest)
            longest, total = max(it.length for it in batch), sum(it.length for it in batch)
            full = len(batch) >= s.max_batch_requests or \
                self._cost(len(batch) + 1, longest, total + longest) > s.max_batch_tokens or \
                len(batch) < len(self._pending)
            if full or waited * 1e3 >= s.max_wait_ms or self._draining:
                self._stepped = False  # the next block of a sample may run after this batch
                taken = set(map(id, batch))
                self._pending = [it for it in self._pending if id(it) not in taken]
                self.metrics.queue_depth.set(len(self._pending))
                return batch
            if not block:
                return []
            self._cond.wait(timeout=s.max_wait_ms / 1e3 - waited)

    def _timing_work(self) -> tuple[Callable[[], object], concurrent.futures.Future]:
        """Under the lock: the next block of the waiting sample's timing, as control work for the worker (nobody
        waits on its future). The next batch goes before another block."""
        self._stepped = True
        work = functools.partial(self._time_step, self._timing)
        work.describe = self._timing.describe  # the slow-work warning's detail (_note_wait)
        return work, concurrent.futures.Future()

    def _time_step(self, sample: _Sample) -> None:
        """One block of an answered batch's inputs again, eagerly, every op timed into the kernel-duration histogram
        once the last block has run. Only instrumentation: a failure is logged, and the answer (already delivered)
        stands."""
        try:
            if sample.steps is None:
                sample.steps = self.embedder.timed_steps(sample.ids, self._record_kernel)
            sample.blocks += 1
            next(sample.steps)
            return  # more blocks to go
        except StopIteration:
            pass
        except Exception as exc:
            log.warning("timing the ops of a sampled batch of %d inputs failed (%s: %s)", len(sample.ids),
                        type(exc).__name__, exc)
        with self._cond:
            if self._timing is sample:
                self._timing = None

    def _sample_timing(self, ids: list[list[int]]) -> None:
        """Keep this batch's inputs to time its ops later (_time_step); one sample waits at a time, later ones are
        not taken meanwhile."""
        with self._cond:
            if self._timing is None and not self._draining:
                self._timing = _Sample(ids, time.monotonic())
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

    def _drop_dead(self) -> None:
        now = time.monotonic()
        alive = []
        for it in self._pending:
            if it.job.cancelled or it.job.finished:
                continue
            if now >= it.job.deadline:
                self.metrics.rejected.labels("timeout").inc()
                it.job.fail(Timeout(f"not served within {self.settings.request_timeout_s:g}s"))
                continue
            alive.append(it)
        self._pending = alive

    def _choose(self, oldest: Item) -> list[Item]:
        """The window of similar lengths around the oldest input that fits the token and row budgets."""
        s = self.settings
        # a stable sort of the arrival-ordered queue: by length, then arrival (cheaper than a (length, enqueued) key
        # at thousands of waiting inputs); the oldest input is the first of its length
        by_length = sorted(self._pending, key=attrgetter("length"))
        lo = hi = bisect.bisect_left([it.length for it in by_length], oldest.length)
        longest = total = oldest.length
        while hi - lo + 1 < s.max_batch_requests:
            left = by_length[lo - 1] if lo > 0 else None
            right = by_length[hi + 1] if hi + 1 < len(by_length) else None
            if left is None and right is None:
                break
            # take the neighbour closer in length (the shorter one on ties: it adds no padding)
            if right is None or (left is not None and oldest.length - left.length <= right.length - oldest.length):
                candidate_longest, step, added = longest, "left", left.length
            else:
                candidate_longest, step, added = max(longest, right.length), "right", right.length
            if self._cost(hi - lo + 2, candidate_longest, total + added) > s.max_batch_tokens:
                break
            longest, total = candidate_longest, total + added
            if step == "left":
                lo -= 1
            else:
                hi += 1
        return by_length[lo : hi + 1]

    def _start(self, batch: list[Item]) -> InFlight | None:
        """Launch `batch` and return it in flight, or run it to the end here (the kernel timer's sampled batches,
        overlap_batches off, or a launch that raised: the synchronous path retries, falls back, splits)."""
        m = self.metrics
        now = time.monotonic()
        for it in batch:
            m.queue_duration.observe(now - it.enqueued)
            if it.job.started is None:
                it.job.started = now
        ids = [it.job.ids[it.index] for it in batch]
        longest = max(len(r) for r in ids)
        real = sum(len(r) for r in ids)
        m.batch_size.observe(len(batch))
        m.batch_tokens.observe(longest * len(batch))
        m.batch_padding_ratio.observe(1 - real / (longest * len(batch)))
        if random.random() < self.settings.kernel_timing_sample_rate:
            self._sample_timing(ids)  # timed after it is answered: the request never waits on the instrumented path
        if self.settings.overlap_batches:
            started = time.perf_counter()
            try:
                pending = self.embedder.launch_ids(ids)
            except Exception as exc:  # OOM or a failing kernel: the synchronous path below retries, falls back
                log.warning("launching a batch of %d inputs failed (%s: %s); running it on the synchronous path",
                            len(ids), type(exc).__name__, exc, exc_info=True)
            else:
                inflight = InFlight(batch, ids, pending, started, self.embedder.path)
                if not pending.ready():
                    return inflight
                self._finish(inflight)  # computed already (the eager paths): deliver now, do not hold it
                return None
        self._complete(batch, ids, lambda: self._forward(ids))
        return None

    def _finish(self, inflight: InFlight) -> None:
        self._complete(inflight.batch, inflight.ids, lambda: self._collect(inflight))

    def _collect(self, inflight: InFlight) -> torch.Tensor:
        """The result of a launched batch; one that raised or came back non-finite runs again synchronously
        (which retries it and falls back to the reference path as an unlaunched batch would)."""
        try:
            pooled = inflight.pending.wait()
            if not np.isfinite(pooled.numpy()).all():
                raise NonFiniteOutput(f"{inflight.path} forward produced NaN/Inf")
        except Exception as exc:
            log.warning("launched batch failed (%s: %s); running it again on the synchronous path",
                        type(exc).__name__, exc, exc_info=not isinstance(exc, NonFiniteOutput))
            return self._forward(inflight.ids)
        self.metrics.forward_duration.labels(inflight.path).observe(time.perf_counter() - inflight.started)
        return pooled

    def _complete(self, batch: list[Item], ids: list[list[int]], forward: Callable[[], torch.Tensor]) -> None:
        """Run `forward` for the batch and deliver each row to its request (or fail them all)."""
        try:
            pooled = forward()
        except torch.cuda.OutOfMemoryError:
            log.error("out of memory even for a single input of %d tokens", max(len(r) for r in ids))
            for it in batch:
                it.job.fail(Unavailable("out of device memory for this input; retry later",
                                        headers={"Retry-After": "1"}))
            return
        except Exception as exc:
            log.exception("batch of %d inputs failed on both paths", len(batch))
            for it in batch:
                it.job.fail(ServiceError(f"inference failed ({type(exc).__name__})"))
            return
        # numpy from here on: every torch call lets go of the GIL and may wait up to a switch interval to get it
        # back from a busy event loop; per-row tensor indexing made that a wait per row under load
        raw = pooled.numpy()
        normalized = l2_normalize(raw)
        for row, it in enumerate(batch):
            it.job.deliver(it.index, normalized[row] if it.job.normalize else raw[row])
        self.batches += 1
        if self.on_batch is not None and random.random() < self.settings.verify_sample_rate:
            self.on_batch(ids, pooled)

    def _forward(self, ids: list[list[int]]) -> torch.Tensor:
        """Pooled, unnormalized embeddings. A batch that runs out of device memory is split in halves and
        retried (a single input that still does not fit fails)."""
        try:
            return self._forward_once(ids)
        except torch.cuda.OutOfMemoryError:
            if len(ids) == 1:
                raise
            log.warning("out of memory on a batch of %d inputs; splitting it in two", len(ids))
            self.metrics.batch_splits.inc()
            if self.embedder.device.type == "cuda":
                torch.cuda.empty_cache()
            half = len(ids) // 2
            return torch.cat([self._forward(ids[:half]), self._forward(ids[half:])])

    def _forward_once(self, ids: list[list[int]]) -> torch.Tensor:
        """One forward on the current path. A fused forward that raises or yields NaN/Inf is re-run on the
        reference path (counted); non-finite output from the reference itself is an error, never an answer."""
        path = self.embedder.path
        started = time.perf_counter()
        try:
            pooled = self.embedder.embed_ids(ids, normalize=False)
            if not np.isfinite(pooled.numpy()).all():
                raise NonFiniteOutput(f"{path} forward produced NaN/Inf")
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as exc:
            if path == "reference":
                raise
            reason = "non_finite" if isinstance(exc, NonFiniteOutput) else "exception"
            log.warning("fused forward failed (%s: %s); re-running the batch on the reference path",
                        type(exc).__name__, exc, exc_info=not isinstance(exc, NonFiniteOutput))
            self.metrics.fallbacks.labels("all", reason).inc()
            path = "reference"
            started = time.perf_counter()
            pooled = self.embedder.embed_ids(ids, normalize=False, reference=True)
            if not np.isfinite(pooled.numpy()).all():
                raise NonFiniteOutput("reference forward produced NaN/Inf") from exc
        self.metrics.forward_duration.labels(path).observe(time.perf_counter() - started)
        return pooled


    def _record_kernel(self, op: str, backend: str, seconds: float) -> None:
        self.metrics.kernel_duration.labels(op, backend).observe(seconds)


class NonFiniteOutput(RuntimeError):
    pass


@dataclass(eq=False)
class InFlight:
    """A launched batch the worker has not finished yet."""

    batch: list[Item]
    ids: list[list[int]]
    pending: Pending
    started: float
    path: str
