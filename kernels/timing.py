"""The one way this project times kernels: the registry's race, the CUDA launch tuner and the benchmarks all
call these. Device time comes from CUDA-graph replays (no Python or launch overhead in it); eager time is a
caller's view (launches from Python, back to back). Both take several rounds and reduce them: `min` where
interference only ever adds time (a race between backends on a shared GPU), `median` for a reported number.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy
import torch

REDUCERS: dict[str, Callable[[list[float]], float]] = {"min": min, "median": statistics.median}
TIMINGS = ("device", "eager")

# 256 MiB: larger than any GPU's L2, so zeroing it evicts whatever the timed call would otherwise find cached
_FLUSH_BYTES = 256 << 20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reducer(reduce: str) -> Callable[[list[float]], float]:
    # checked before any timing, so a typo fails at once instead of after a sweep
    if reduce not in REDUCERS:
        raise ValueError(f"reduce must be one of {tuple(REDUCERS)}, got {reduce!r}")
    return REDUCERS[reduce]


def _check_counts(calls: int, rounds: int) -> None:
    if calls < 1 or rounds < 1:
        raise ValueError(f"calls and rounds must be at least 1, got calls={calls}, rounds={rounds}")


def capture(fn: Callable[[], object], calls: int = 1, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` back-to-back calls of `fn`, after `warmup` calls on a side stream (compilation,
    autotuning and launch-configuration sweeps happen there, never inside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # other threads may use the device meanwhile
        for _ in range(calls):
            fn()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, calls: int, rounds: int, *, flush_l2: bool = False) -> list[float]:
    """Microseconds per call of each of `rounds` replays of `graph` (which holds `calls` calls)."""
    _check_counts(calls, rounds)
    flush = torch.empty(_FLUSH_BYTES, dtype=torch.int8, device="cuda") if flush_l2 else None
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(rounds)]
    for start, end in events:
        if flush is not None:
            flush.zero_()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1e3 / calls for start, end in events]


def device_us(fn: Callable[[], object], *, calls: int = 10, rounds: int = 5, reduce: str = "median",
              flush_l2: bool = False) -> float:
    """Device time of one call of `fn` in microseconds: `calls` calls captured in one CUDA graph, replayed
    `rounds` times, reduced with `reduce` (min or median). flush_l2: evict the L2 before each replay (a kernel
    benchmark's cold-cache number; take calls=1 then)."""
    reducer = _reducer(reduce)
    _check_counts(calls, rounds)
    graph = capture(fn, calls)
    graph.replay()  # the first replay also uploads the graph to the device: not timed
    return reducer(replay_us(graph, calls, rounds, flush_l2=flush_l2))


AUTOTUNE_ROUNDS = 50


def autotune_bench(fn: Callable[[], object], quantiles: tuple[float, ...] | None = None) -> float | list[float]:
    """The Triton autotuner's benchmark on a GPU (its `do_bench`): a candidate's device time as the model runs it
    (replayed from a CUDA graph) and as the kernel benchmark reports it, one call per replay with the L2 flushed
    before each, in milliseconds (the median, or the given quantiles). Triton's default times stream launches for
    100 ms per candidate instead. The candidates of a LayerNorm-family key are often close enough that launch
    overhead would decide between them, and the kernel benchmark ranks them this way; the registry's race, which picks
    between backends, times CUDA-graph replays too, of several calls each and without the flush."""
    graph = capture(fn, calls=1, warmup=1)
    graph.replay()  # uploads the graph: not timed
    samples = [us / 1e3 for us in replay_us(graph, 1, AUTOTUNE_ROUNDS, flush_l2=True)]
    if not quantiles:
        return statistics.median(samples)
    # interpolated linearly between the two nearest samples: 0 is the smallest, 1 the largest
    return [float(q) for q in numpy.quantile(samples, quantiles)]


def eager_us(fn: Callable[[], object], device: torch.device, *, calls: int = 10, rounds: int = 5,
             reduce: str = "median", warmup: int = 3) -> float:
    """Time of one call of `fn` as its caller sees it, in microseconds: `calls` calls launched back to back from
    Python then a device sync, `rounds` times, reduced with `reduce`."""
    reducer = _reducer(reduce)
    _check_counts(calls, rounds)
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - started) * 1e6 / calls)
    return reducer(samples)


def interleaved_us(fns: dict[str, Callable[[], object]], device: torch.device, *, timing: str, calls: int,
                   rounds: int, reduce: str = "min") -> dict[str, float]:
    """Microseconds per call of each of `fns`, timed in interleaved rounds (clock or thermal drift hits every
    candidate alike): timing="device" replays a CUDA graph of `calls` calls per candidate, "eager" launches them
    from Python. The registry's race uses this with reduce="min". No warm-up calls: the caller has made them
    (compilation and autotuning must not happen inside a capture or a timed round)."""
    reducer = _reducer(reduce)
    _check_counts(calls, rounds)
    if timing not in TIMINGS:
        raise ValueError(f"timing must be one of {TIMINGS}, got {timing!r}")
    device = torch.device(device)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    if timing == "device":
        if device.type != "cuda":
            raise RuntimeError(f"device timing needs CUDA graphs, and {device} has none")
        graphs = {name: capture(fn, calls, warmup=0) for name, fn in fns.items()}
        for graph in graphs.values():
            graph.replay()  # the first replay also uploads the graph to the device: not timed
        for _ in range(rounds):
            for name, graph in graphs.items():
                samples[name] += replay_us(graph, calls, 1)
    else:
        for _ in range(rounds):
            for name, fn in fns.items():
                samples[name].append(eager_us(fn, device, calls=calls, rounds=1, warmup=0))
    return {name: reducer(v) for name, v in samples.items()}


class OpTimer:
    """Per-call timing of ops inside a forward without a sync per call: CUDA events on a GPU (read after the
    forward, in `results()`), the host clock on the CPU. `call(op, backend, fn, args, kwargs)` runs `fn` timed."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._samples: list[tuple[str, str, object]] = []

    def call(self, op: str, backend: str, fn: Callable, args: tuple, kwargs: dict):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            self._samples.append((op, backend, (start, end)))
        else:
            started = time.perf_counter()
            out = fn(*args, **kwargs)
            self._samples.append((op, backend, time.perf_counter() - started))
        return out

    def results(self) -> list[tuple[str, str, float]]:
        """(op, backend, seconds) per call, in call order (synchronizes the device once)."""
        _sync(self.device)
        return [(op, backend, s[0].elapsed_time(s[1]) / 1e3 if isinstance(s, tuple) else s)
                for op, backend, s in self._samples]
