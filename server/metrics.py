"""Every Prometheus metric of the service: one prefix, units in names, buckets defined here, a `model` label on
everything a model does. Each app instance owns its own registry (tests run several apps in one process).

With WORKERS > 1 (server.workers) prometheus-client runs in multiprocess mode (PROMETHEUS_MULTIPROC_DIR): every
worker writes its values to files there and any worker's /metrics reads them all. Counters and histograms are
summed; each gauge says how its workers' values combine (`multiprocess_mode`: queue depth and memory are summed over
the workers, the fused switch and readiness are the least of them, the last reference check is the most recent).
What is read at scrape time in one process (CUDA-graph counters, device memory) is copied into such files by each
worker once a second instead. The process_* families then describe the worker that answered."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                               generate_latest, multiprocess)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from fusedserve.model import host

log = logging.getLogger("fusedserve")

PREFIX = "fusedserve_"

LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
KERNEL_BUCKETS = (1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class Metrics:
    """The server's registry. Every family about a model's work carries a `model` label (its first); a request not
    routed to a model (a probe, an unknown model's 404) counts under model="". ModelMetrics is one model's view."""

    def __init__(self, device: str = "cpu", holds_device: bool = True) -> None:
        """holds_device: false in a front-end of engines (FRONTENDS), which runs no forward on `device`."""
        self.device = device  # this process's device, by the name the operator gave (server.devices)
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self._refreshers: list[Callable[[], None]] = []
        self.registry = r = CollectorRegistry()
        self.requests = Counter(PREFIX + "requests", "HTTP and gRPC requests by model, route and status",
                                ["model", "route", "status"], registry=r)
        self.request_duration = Histogram(PREFIX + "request_duration_seconds", "Request latency", ["model", "route"],
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.queue_duration = Histogram(PREFIX + "queue_duration_seconds", "Time an input waited for its batch",
                                        ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge(PREFIX + "queue_depth", "Inputs waiting for a batch", ["model"], registry=r,
                                 multiprocess_mode="livesum")
        self.rejected = Counter(PREFIX + "rejected_requests", "Requests refused or dropped, by reason",
                                ["model", "reason"], registry=r)
        self.batch_size = Histogram(PREFIX + "batch_size", "Inputs per batch", ["model"], buckets=SIZE_BUCKETS,
                                    registry=r)
        self.batch_tokens = Histogram(PREFIX + "batch_tokens", "Padded tokens per batch", ["model"],
                                      buckets=TOKEN_BUCKETS, registry=r)
        self.batch_padding_ratio = Histogram(PREFIX + "batch_padding_ratio", "Padding share of a batch's tokens",
                                             ["model"], buckets=RATIO_BUCKETS, registry=r)
        self.kernel_duration = Histogram(PREFIX + "kernel_duration_seconds", "Fused-op latency on sampled batches",
                                         ["model", "op", "backend"], buckets=KERNEL_BUCKETS, registry=r)
        self.forward_duration = Histogram(PREFIX + "forward_duration_seconds", "Encoder forward per batch",
                                          ["model", "path"], buckets=LATENCY_BUCKETS, registry=r)
        self.reference_checks = Counter(PREFIX + "reference_checks", "Sampled fused-vs-reference checks",
                                        ["model", "result"], registry=r)
        self.reference_max_abs_error = Gauge(PREFIX + "reference_max_abs_error",
                                             "Max abs error of the last reference check", ["model"], registry=r,
                                             multiprocess_mode="mostrecent")
        self.reference_cosine_distance = Gauge(PREFIX + "reference_cosine_distance",
                                               "Max cosine distance of the last reference check", ["model"],
                                               registry=r, multiprocess_mode="mostrecent")
        self.fallbacks = Counter(PREFIX + "fallbacks", "Switches of ops to the reference path",
                                 ["model", "op", "reason"], registry=r)
        self.fp8_enabled = Gauge(PREFIX + "fp8_enabled", "1 while the model's GEMMs run in FP8 (precision=fp8, not "
                                 "fallen back)", ["model"], registry=r, multiprocess_mode="min")
        self.precision_fallbacks = Counter(PREFIX + "precision_fallbacks", "Moves of a model's GEMMs from FP8 back "
                                           "to its dtype", ["model", "reason"], registry=r)
        self.batch_splits = Counter(PREFIX + "batch_splits", "Batches split in two after running out of device memory",
                                    ["model"], registry=r)
        self.backend_info = Gauge(PREFIX + "backend_info", "1 for the backend serving each op",
                                  ["model", "op", "backend"], registry=r, multiprocess_mode="max")
        self.fused_enabled = Gauge(PREFIX + "fused_enabled", "1 when the fused path is on", ["model"], registry=r,
                                   multiprocess_mode="min")
        self.model_ready = Gauge(PREFIX + "model_ready", "1 while the model serves; 0 while it loads or after it "
                                 "failed to load", ["model"], registry=r, multiprocess_mode="min")
        self.device_memory = Gauge(PREFIX + "device_memory_bytes", "GPU memory held by the process (CUDA only)",
                                   ["kind"], registry=r, multiprocess_mode="livesum")
        # per device: the workers on it, and the seconds its forwards took (every worker's summed: under CUDA MPS a
        # GPU's workers overlap, so busy seconds can pass wall seconds; the rate against the worker count says how
        # much of the time each one kept the device busy)
        self.device_busy = Counter(PREFIX + "device_busy_seconds", "Seconds of forwards run on each device",
                                   ["device"], registry=r)
        self.device_workers = Gauge(PREFIX + "device_workers", "Server processes serving on each device", ["device"],
                                    registry=r, multiprocess_mode="livesum")
        # the real (unpadded) tokens each device's batches ran: its share of the server's tokens/s
        self.device_tokens = Counter(PREFIX + "device_tokens", "Input tokens of the batches run on each device",
                                     ["device"], registry=r)
        if holds_device:
            self.device_busy.labels(device)
            self.device_tokens.labels(device)
            self.device_workers.labels(device).set(1)
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_cpu_seconds_total, ...
        if self.multiprocess:
            self._graph_families = {
                "graphs": Gauge(PREFIX + "cuda_graphs", _GRAPH_HELP["graphs"], ["model"], registry=None,
                                multiprocess_mode="livesum"),
                "pool_bytes": Gauge(PREFIX + "cuda_graph_pool_bytes", _GRAPH_HELP["pool_bytes"], ["model"],
                                    registry=None, multiprocess_mode="livesum"),
                **{key: Counter(PREFIX + name, _GRAPH_HELP[key], ["model"], registry=None)
                   for name, key in _GRAPH_COUNTERS}}
            self._graph_seen: dict[tuple[str, str], float] = {}
            # process_cpu_seconds_total describes the worker answering the scrape: this sums every worker's
            cpu = Gauge(PREFIX + "worker_cpu_seconds", "User + system CPU time of the server's workers, summed",
                        registry=None, multiprocess_mode="livesum")
            self._refresh_every_second(lambda: cpu.set(time.process_time()))
        self._watched_devices: set[str] = set()

    def exposition(self) -> tuple[bytes, str]:
        """/metrics' body and content type: this registry, or every worker's files in multiprocess mode."""
        if not self.multiprocess:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        ProcessCollector(registry=registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST

    def _refresh_every_second(self, fn: Callable[[], None]) -> None:
        """Multiprocess mode: run `fn` now and once a second on a daemon thread (values read at scrape time in a
        single process are written to the shared files instead)."""
        fn()
        self._refreshers.append(fn)
        if len(self._refreshers) == 1:
            def loop() -> None:
                failing: set[int] = set()
                while True:
                    threading.Event().wait(1.0)
                    for i, refresh in enumerate(list(self._refreshers)):
                        try:
                            refresh()
                            failing.discard(i)
                        except Exception:  # logged once per failing refresher; the others keep going
                            if i not in failing:
                                log.exception("copying scrape-time metrics for the other workers failed")
                            failing.add(i)

            threading.Thread(target=loop, name="fusedserve-metrics", daemon=True).start()

    def for_model(self, model: str, ops: Iterable[str] = ()) -> ModelMetrics:
        """The series of one model, whose forward calls `ops` (each gets its fallback series from the start)."""
        return ModelMetrics(self, model, ops)

    def watch_device_memory(self, device: str) -> None:
        """Read CUDA allocator numbers at scrape time (nothing to report on the CPU). The models share the device:
        these are the process's numbers, not a model's. device: as a model describes it ("cpu", "cuda:0")."""
        if not device.startswith("cuda") or device in self._watched_devices:
            return
        self._watched_devices.add(device)
        if self.multiprocess:
            def refresh() -> None:
                allocated, reserved = host.memory(device)
                self.device_memory.labels("allocated").set(allocated)
                self.device_memory.labels("reserved").set(reserved)

            self._refresh_every_second(refresh)
            return
        self.device_memory.labels("allocated").set_function(lambda: host.memory(device)[0])
        self.device_memory.labels("reserved").set_function(lambda: host.memory(device)[1])

    def watch_cuda_graphs(self, graphs: Callable[[], Iterable[tuple[str, dict]]]) -> None:
        """Export each loaded model's CUDA-graph counters at scrape time: `graphs()` yields (model, stats) pairs,
        stats empty for a model without graphs (the CPU, or graphs off), whose series then read 0, so dashboards
        and alerts see them either way."""
        if not self.multiprocess:
            self.registry.register(_GraphCollector(graphs))
            return

        def refresh() -> None:
            for model, stats in graphs():
                for key, family in self._graph_families.items():
                    value = float(stats.get(key, 0))
                    if isinstance(family, Gauge):
                        family.labels(model).set(value)
                    else:  # a counter: what it grew by since the last refresh
                        seen = self._graph_seen.get((model, key), 0.0)
                        family.labels(model).inc(max(value - seen, 0.0))
                        self._graph_seen[model, key] = value

        self._refresh_every_second(refresh)


class _Labelled:
    """A family with further labels, its `model` label filled in: `.labels(*the rest)`."""

    __slots__ = ("family", "model")

    def __init__(self, family, model: str) -> None:
        self.family, self.model = family, model

    def labels(self, *values: str):
        return self.family.labels(self.model, *values)


class _Forwards:
    """forward_duration{model, path}; every forward it times is also busy time of the process's device."""

    __slots__ = ("family", "model", "busy")

    def __init__(self, family, model: str, busy) -> None:
        self.family, self.model, self.busy = family, model, busy

    def labels(self, path: str) -> _Forward:
        return _Forward(self.family.labels(self.model, path), self.busy)


class _Forward:
    __slots__ = ("child", "busy")

    def __init__(self, child, busy) -> None:
        self.child, self.busy = child, busy

    def observe(self, seconds: float) -> None:
        self.child.observe(seconds)
        self.busy.inc(seconds)


class ModelMetrics:
    """One model's series: the attributes of Metrics that the batcher, the verifier and the model's service write,
    with model=<name> filled in (a family without further labels is its child; one with more is `_Labelled`)."""

    def __init__(self, metrics: Metrics, model: str, ops: Iterable[str] = ()) -> None:
        self.model = model
        self.queue_duration = metrics.queue_duration.labels(model)
        self.queue_depth = metrics.queue_depth.labels(model)
        self.rejected = _Labelled(metrics.rejected, model)
        self.batch_size = metrics.batch_size.labels(model)
        self.batch_tokens = metrics.batch_tokens.labels(model)
        self.batch_padding_ratio = metrics.batch_padding_ratio.labels(model)
        self.kernel_duration = _Labelled(metrics.kernel_duration, model)
        self.forward_duration = _Forwards(metrics.forward_duration, model, metrics.device_busy.labels(metrics.device))
        self.device_tokens = metrics.device_tokens.labels(metrics.device)
        self.reference_checks = _Labelled(metrics.reference_checks, model)
        self.reference_max_abs_error = metrics.reference_max_abs_error.labels(model)
        self.reference_cosine_distance = metrics.reference_cosine_distance.labels(model)
        self.fallbacks = _Labelled(metrics.fallbacks, model)
        self.batch_splits = metrics.batch_splits.labels(model)
        self.fused_enabled = metrics.fused_enabled.labels(model)
        self.fp8_enabled = metrics.fp8_enabled.labels(model)
        self.precision_fallbacks = _Labelled(metrics.precision_fallbacks, model)
        self.precision_fallbacks.labels("fp8_mismatch")
        self._backend_info = metrics.backend_info
        self._backends: list[tuple[str, str]] = []
        for result in ("match", "mismatch", "error", "dropped"):
            self.reference_checks.labels(result)
        for reason in ("queue_full", "timeout", "cancelled", "draining", "predicted_timeout"):
            self.rejected.labels(reason)
        # every known fallback series exists from the start, so dashboards and alerts see 0, not nothing
        self.fallbacks.labels("all", "exception")
        self.fallbacks.labels("all", "non_finite")
        for op in ops:
            self.fallbacks.labels(op, "verify_mismatch")

    def set_backends(self, choices: dict[str, str], fused: bool) -> None:
        """backend_info: 1 for each op's backend now; this model's earlier series go (other models' stay)."""
        for op, backend in self._backends:
            self._backend_info.labels(self.model, op, backend).set(0)  # what multiprocess mode's files keep
            self._backend_info.remove(self.model, op, backend)
        self._backends = list(choices.items())
        for op, backend in self._backends:
            self._backend_info.labels(self.model, op, backend).set(1)
        self.fused_enabled.set(1 if fused else 0)


_GRAPH_HELP = {
    "graphs": "CUDA graphs held (one per shape bucket)",
    "pool_bytes": "Device memory the CUDA graphs hold",
    "captures": "CUDA graphs captured (new shape buckets, or after eviction)",
    "replays": "Batches served by replaying a CUDA graph",
    "eager_fallbacks": "Batches outside every CUDA-graph bucket (or not captured yet), run eagerly",
}
_GRAPH_COUNTERS = (("cuda_graph_captures", "captures"), ("cuda_graph_replays", "replays"),
                   ("cuda_graph_eager_fallbacks", "eager_fallbacks"))


class _GraphCollector:
    """fusedserve_cuda_graphs (held) and the capture / replay / eager-fallback counters of each model's CUDA-graph
    runner; capture thrash (captures rising under steady traffic) is what to watch."""

    def __init__(self, graphs: Callable[[], Iterable[tuple[str, dict]]]) -> None:
        self.graphs = graphs

    def collect(self):
        models = list(self.graphs())
        held = GaugeMetricFamily(PREFIX + "cuda_graphs", _GRAPH_HELP["graphs"], labels=["model"])
        pool = GaugeMetricFamily(PREFIX + "cuda_graph_pool_bytes", _GRAPH_HELP["pool_bytes"], labels=["model"])
        for model, stats in models:
            held.add_metric([model], stats.get("graphs", 0))
            pool.add_metric([model], stats.get("pool_bytes", 0))
        yield held
        yield pool
        for name, key in _GRAPH_COUNTERS:
            family = CounterMetricFamily(PREFIX + name, _GRAPH_HELP[key], labels=["model"])
            for model, stats in models:
                family.add_metric([model], stats.get(key, 0))
            yield family
