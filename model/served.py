"""A model behind the seam (fusedserve.model.api.ServedModel): an Embedder (the device work: packing, CUDA graphs,
the kernel selection) plus what the seam adds around it: text preparation (the one place prompts, lower-casing and
truncation happen), the output block, the description, the start-up's warm-up and the background work."""

from __future__ import annotations

import itertools
import logging
import math
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from fusedserve import kernels
from fusedserve.model import colbert, describing
from fusedserve.model.api import (Description, InputError, LoadOptions, OutOfDeviceMemory, Output, Rows, TextOptions,
                                  Worker, name_of)
from fusedserve.model.forwards import Pending
from fusedserve.model.loading import LoadReport, cpu_isa
from fusedserve.model.runner import Embedder

log = logging.getLogger("fusedserve.model")

# after ready, the longest that batches without their CUDA graph run eagerly while the rest are captured when idle;
# under traffic that never leaves the model idle, a bucket still missing then is captured when its batch comes
CAPTURE_AHEAD_S = 120.0


@contextlib.contextmanager
def _device_memory_errors() -> Iterator[None]:
    """torch's out-of-memory as the seam's OutOfDeviceMemory, after giving the allocator's cached blocks back (the
    server retries a smaller batch, which may then fit where fragments of this one's did not)."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as exc:
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        raise OutOfDeviceMemory(str(exc)) from exc


class _Block:
    """A launched forward as the seam shows it: the runner's Pending, its result as one float32 numpy block."""

    __slots__ = ("_pending", "path")

    def __init__(self, pending: Pending, path: str) -> None:
        self._pending, self.path = pending, path

    def ready(self) -> bool:
        return self._pending.ready()

    def rows(self) -> np.ndarray:
        with _device_memory_errors():
            return self._pending.wait().numpy()


def _bytes_of(*modules: torch.nn.Module) -> int:
    """Bytes of the modules' parameters and buffers (each tensor once, however often it is shared)."""
    seen, total = set(), 0
    for tensor in itertools.chain.from_iterable(itertools.chain(m.parameters(), m.buffers()) for m in modules):
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


# the kernel layer's watch for compiles and autotunes after ready is process-wide: one watch, whatever the models
_watching = threading.Lock()
_watchers = 0


def _compiled_after_ready(kernel: str) -> None:
    log.warning("a Triton kernel was compiled or loaded after ready, and whatever launched it waited (expected after "
                "a backend switch; otherwise a shape the start-up's compile pass missed): %s", kernel)


_autotunes_logged: dict[str, float] = {}


def _autotuned_after_ready(kernel: str) -> None:
    now = time.monotonic()
    if now - _autotunes_logged.get(kernel, -math.inf) < 60.0:  # an autotune calls back once for every candidate
        return
    _autotunes_logged[kernel] = now
    log.warning("the Triton autotuner of %s timed its candidates after ready, and whatever launched it waited (a key "
                "the start-up's shape sweep did not tune, or the shipped tuning lacks)", kernel)


class Served:
    """One model behind the seam. prepare() is thread-safe (request threads call it); everything that touches the
    device runs on the Worker's thread (launch, time_ops, the switches, warm-up and background work)."""

    def __init__(self, embedder: Embedder, load: LoadReport | None, options: LoadOptions) -> None:
        self.embedder, self._load, self.options = embedder, load, options
        e = embedder
        self.name = e.name
        self.kind = e.kind
        self._limit = e.config.max_seq_length
        self._memory = {"parameters_bytes": _bytes_of(e.encoder, e.head)}
        self._text = e.text.spec() if e.text is not None else None
        if e.kernel_path.fp8_bytes:
            self._memory["fp8_weights_bytes"] = e.kernel_path.fp8_bytes
        self._background: threading.Thread | None = None
        self._stopping = threading.Event()
        self._watching = False
        self.graph_warmup: tuple[int, float] | None = None  # (graphs captured before ready, seconds)
        self.graphs_after_ready: tuple[int, float] | None = None  # (the rest, captured while idle; seconds)

    # ---- what it is -------------------------------------------------------------------------------------------
    def describe(self) -> Description:
        e, path = self.embedder, self.embedder.kernel_path
        state = e.describe()
        graphs = e.graphs.stats() if e.graphs is not None else {}
        memory = dict(self._memory)
        if e.graphs is not None:
            memory["cuda_graph_pool_bytes"] = graphs.get("pool_bytes", 0)
        classifier = e.classifier
        return Description(
            name=self.name, kind=self.kind, dim=e.dim, max_length=self._limit, device=str(e.device),
            labels=tuple(classifier.labels) if classifier is not None else (),
            activation=classifier.activation if classifier is not None else "identity",
            fused=path.fused, path=path.label, precision=path.active_precision, kernels=dict(path.selection.used),
            graphs=graphs, memory=memory, text=self._text,
            outputs=colbert.OUTPUTS if e.colbert is not None else
            ("pooled", "tokens", "colbert", "sparse") if e.m3 is not None else ("pooled", "tokens"),
            info={"max_seq_length": self._limit, "device": str(e.device),
                  "dtype": str(e.dtype).removeprefix("torch."), "cpu_isa": cpu_isa(e.device, e.dtype), **state},
            report=self._report())

    def _report(self) -> str:
        e = self.embedder
        lines = [str(self._load) if self._load is not None else f"model {self.name}", describing.path_line(e)]
        if self.graph_warmup is not None:
            lines.append(f"CUDA graphs: {self.graph_warmup[0]} buckets captured before ready, "
                         f"{e.forwards.graphs_pending} more to capture while idle")
        memory = ", ".join(f"{k.removesuffix('_bytes').replace('_', ' ')} {v / 2**20:.1f} MiB"
                           for k, v in self._memory.items())
        lines.append(f"memory on {e.device}: {memory}")
        return "\n".join(lines)

    # ---- text and ids in (any thread) ------------------------------------------------------------------------
    def prepare(self, inputs: Sequence, options: TextOptions) -> Rows:
        return self.embedder.text.prepare(inputs, options)

    def decode(self, rows: Sequence[Sequence[int]], skip_special_tokens: bool) -> list[str]:
        return self.embedder.text.decode(rows, skip_special_tokens)

    # ---- forwards (the worker's thread) -----------------------------------------------------------------------
    def launch(self, rows: Rows, *, output: Output = "pooled", reference: bool = False) -> _Block:
        e = self.embedder
        with _device_memory_errors():
            if e.colbert is not None:  # per-token outputs only (model.colbert)
                return _Block(Pending(colbert.launch(e.forwards, e.head, rows, output, self.name)),
                              e.kernel_path.label)
            if output == "tokens":
                return _Block(Pending(e.forwards.embed_tokens(rows)), e.kernel_path.label)
            if output in ("colbert", "sparse", "m3"):
                if e.m3 is None:
                    raise InputError(f"model {self.name} has no {output} output (BGE-M3's heads)", param="output")
                block = e.forwards.token_states(rows, lambda hidden, packed: e.m3.block(output, hidden, packed, e.head))
                return _Block(Pending(block.cpu()), e.kernel_path.label)
            if reference:
                return _Block(Pending(e.embed_ids(rows, normalize=False, reference=True)), "reference")
            return _Block(e.launch_ids(rows), e.kernel_path.label)

    def time_ops(self, rows: Rows, callback: Callable[[str, str, float], None]) -> Iterator[None]:
        return self.embedder.timed_steps(rows, callback)

    # ---- switches (the worker's thread, between batches) ------------------------------------------------------
    def set_fused(self, enabled: bool) -> Description:
        self.embedder.kernel_path.set_fused(enabled)
        return self.describe()

    def fall_back(self, reason: str) -> tuple[str, ...]:
        path = self.embedder.kernel_path
        if path.fallback:
            return ()
        ops = tuple(path.selection.used)
        path.fall_back("all", reason)
        return ops

    def fall_back_precision(self, reason: str) -> bool:
        return self.embedder.kernel_path.fall_back_precision(reason)

    def reference_copy(self) -> Served:
        copy = Served(self.embedder.reference_copy(), None, self.options)
        copy._memory = {"parameters_bytes": _bytes_of(copy.embedder.encoder, copy.embedder.head)}
        return copy

    # ---- start-up and background work -------------------------------------------------------------------------
    def warm_up(self, worker: Worker, progress: Callable[[str, float | None], None]) -> dict[str, float]:
        """On a GPU: the sweep's Triton kernels compiled side by side (Forwards.compile_ahead), then the shape sweep
        (an eager forward at every launch shape a batch can meet, WarmupPlanner.shape_sweep: what is compiled and
        tuned then, no request pays for later), then the first `graphs_before_ready` CUDA graphs in order of need. On
        the CPU nothing is compiled or tuned per shape: the largest batch and a short one warm the allocator."""
        e, seconds = self.embedder, {}
        started = time.perf_counter()
        sweep = e.warmup.shape_sweep() if e.device.type == "cuda" else e.warmup.warmup_batches()
        if e.device.type == "cuda" and "triton" in e.kernel_path.selection.used.values():
            progress("warmup", None)  # the compiles run side by side and end together: no fraction to report
            try:
                worker.between_batches(lambda: e.forwards.compile_ahead(sweep)).result()
            except Exception as exc:  # only a head start: the sweep below compiles whatever this did not
                log.warning("warm-up of %s: compiling ahead failed (%s: %s); the shape sweep compiles its kernels "
                            "one by one", self.name, type(exc).__name__, exc)
            else:
                log.info("warm-up of %s: kernels of %d launch shapes compiled in %.1fs", self.name, len(sweep),
                         time.perf_counter() - started)
            seconds["compiles"] = time.perf_counter() - started
        phase = time.perf_counter()
        for i, batch in enumerate(sweep):
            progress("warmup", i / len(sweep))
            worker.between_batches(lambda batch=batch: e.embed_ids(batch, graphs=False)).result()
        if e.colbert is not None:  # its own forward: queries with unattended expansion run the padded layout
            rows = e.text.prepare(["warm up"] * 2, TextOptions())
            worker.between_batches(lambda: colbert.launch(e.forwards, e.head, rows, "colbert", self.name)).result()
        kernels.save_tuning(e.device)  # every launch shape met: what the kernels tuned, kept for the next start
        seconds["shape sweep"] = time.perf_counter() - phase
        log.info("warm-up of %s: %d launch shapes run in %.1fs", self.name, len(sweep), seconds["shape sweep"])
        limit = self.options.graphs_before_ready
        if e.graphs is not None and limit is not None:
            e.graphs.defer_captures_until = math.inf  # captured ahead from here on: no batch waits for a capture
            progress("cuda_graphs", 0.0)
            phase = time.perf_counter()

            def captured(done: int, todo: int) -> None:
                progress("cuda_graphs", done / max(todo, 1))
                if done % max(todo // 4, 1) == 0 or done == todo:
                    log.info("capturing CUDA graphs of %s: %d/%d (%.1fs)", self.name, done, todo,
                             time.perf_counter() - phase)

            count = worker.between_batches(lambda: e.forwards.capture_graphs(captured, limit)).result()
            seconds["cuda graphs"] = time.perf_counter() - phase
            self.graph_warmup = (count, seconds["cuda graphs"])
        return seconds

    def run_background(self, worker: Worker) -> None:
        self._watch()
        e = self.embedder
        if e.graphs is None or self.options.graphs_before_ready is None or self._background is not None:
            return
        e.graphs.defer_captures_until = time.monotonic() + CAPTURE_AHEAD_S

        def run() -> None:
            started, count = time.perf_counter(), 0
            try:
                while not self._stopping.is_set() and worker.when_idle(e.forwards.capture_next_graph).result():
                    count += 1
            except Exception as exc:
                if self._stopping.is_set():  # shutting down: the worker refused the rest
                    return
                log.exception("capturing the CUDA graphs of %s after ready failed (%s); batches without a graph run "
                              "eagerly, or capture it when they come", self.name, type(exc).__name__)
            finally:
                e.graphs.defer_captures_until = 0.0  # from now on (an evicted bucket, a new selection) on first use
            self.graphs_after_ready = (count, time.perf_counter() - started)
            log.info("CUDA graphs of %s: %d more buckets captured after ready in %.1fs (while idle)", self.name,
                     count, self.graphs_after_ready[1])

        self._background = threading.Thread(target=run, name=f"fusedserve-graphs[{self.name}]", daemon=True)
        self._background.start()

    def _watch(self) -> None:
        """Log a kernel compiled or autotuned after ready (the start-up should have left none): process-wide hooks,
        installed by the first model to get here and removed by the last to stop."""
        global _watchers
        with _watching:
            if self._watching:
                return
            self._watching = True
            _watchers += 1
            if _watchers == 1:
                try:
                    kernels.watch_compiles(_compiled_after_ready)
                    kernels.watch_autotunes(_autotuned_after_ready)
                except Exception:  # log lines only: never a reason to stop a server that is ready
                    log.exception("watching for kernels compiled or autotuned after ready failed")

    def stop(self) -> None:
        global _watchers
        self._stopping.set()
        with _watching:
            if not self._watching:
                return
            self._watching = False
            _watchers -= 1
            if _watchers == 0:
                for unwatch in (kernels.watch_compiles, kernels.watch_autotunes):
                    try:
                        unwatch(None)
                    except Exception:
                        log.exception("removing the kernel watch failed")


def load_served(path: str, options: LoadOptions) -> Served:
    # the op names are the kernel layer's; checked here, before a checkpoint is read, naming the option (and setting)
    unknown = sorted(set(options.backend_overrides) - set(kernels.OPS))
    if unknown:
        raise ValueError(f"backend_overrides: unknown op(s) {unknown}; ops are {', '.join(kernels.OPS)}")
    if options.cache_dir:
        kernels.configure(cache_dir=options.cache_dir)
    embedder, report = Embedder.load(
        path, device=options.device, dtype=options.dtype, fused=options.fused, backend=options.backend,
        backend_overrides=dict(options.backend_overrides), max_seq_length=options.max_seq_length,
        pooling=options.pooling, attention=options.attention, cuda_graphs=options.cuda_graphs,
        max_batch_tokens=options.max_batch_tokens, max_batch=options.max_batch, max_graphs=options.max_graphs,
        precision=options.precision, name=name_of(path))
    return Served(embedder, report, options)
