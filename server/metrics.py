"""Every Prometheus metric of the service: one prefix, units in names, buckets defined here.
Each app instance owns its own registry (tests run several apps in one process)."""

from __future__ import annotations

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from model.runner import KERNEL_OPS

PREFIX = "fusedserve_"

LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
KERNEL_BUCKETS = (1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(PREFIX + "requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.request_duration = Histogram(PREFIX + "request_duration_seconds", "Request latency", ["route"],
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.queue_duration = Histogram(PREFIX + "queue_duration_seconds", "Time an input waited for its batch",
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge(PREFIX + "queue_depth", "Inputs waiting for a batch", registry=r)
        self.rejected = Counter(PREFIX + "rejected_requests", "Requests refused or dropped, by reason", ["reason"],
                                registry=r)
        self.batch_size = Histogram(PREFIX + "batch_size", "Inputs per batch", buckets=SIZE_BUCKETS, registry=r)
        self.batch_tokens = Histogram(PREFIX + "batch_tokens", "Padded tokens per batch", buckets=TOKEN_BUCKETS,
                                      registry=r)
        self.batch_padding_ratio = Histogram(PREFIX + "batch_padding_ratio", "Padding share of a batch's tokens",
                                             buckets=RATIO_BUCKETS, registry=r)
        self.kernel_duration = Histogram(PREFIX + "kernel_duration_seconds", "Fused-op latency on sampled batches",
                                         ["op", "backend"], buckets=KERNEL_BUCKETS, registry=r)
        self.forward_duration = Histogram(PREFIX + "forward_duration_seconds", "Encoder forward per batch", ["path"],
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.reference_checks = Counter(PREFIX + "reference_checks", "Sampled fused-vs-reference checks", ["result"],
                                        registry=r)
        self.reference_max_abs_error = Gauge(PREFIX + "reference_max_abs_error",
                                             "Max abs error of the last reference check", registry=r)
        self.reference_cosine_distance = Gauge(PREFIX + "reference_cosine_distance",
                                               "Max cosine distance of the last reference check", registry=r)
        self.fallbacks = Counter(PREFIX + "fallbacks", "Switches of ops to the reference path", ["op", "reason"],
                                 registry=r)
        self.batch_splits = Counter(PREFIX + "batch_splits", "Batches split in two after running out of device memory",
                                    registry=r)
        self.backend_info = Gauge(PREFIX + "backend_info", "1 for the backend serving each op", ["op", "backend"],
                                  registry=r)
        self.fused_enabled = Gauge(PREFIX + "fused_enabled", "1 when the fused path is on", registry=r)
        self.device_memory = Gauge(PREFIX + "device_memory_bytes", "GPU memory held by the process (CUDA only)",
                                   ["kind"], registry=r)
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_cpu_seconds_total, ...
        for result in ("match", "mismatch", "error", "dropped"):
            self.reference_checks.labels(result)
        for reason in ("queue_full", "timeout", "cancelled", "draining"):
            self.rejected.labels(reason)
        # every known fallback series exists from the start, so dashboards and alerts see 0, not nothing
        self.fallbacks.labels("all", "exception")
        self.fallbacks.labels("all", "non_finite")
        for op in KERNEL_OPS:
            self.fallbacks.labels(op, "verify_mismatch")

    def watch_device_memory(self, device: torch.device) -> None:
        """Read CUDA allocator numbers at scrape time (nothing to report on the CPU)."""
        if device.type != "cuda":
            return
        self.device_memory.labels("allocated").set_function(lambda: torch.cuda.memory_allocated(device))
        self.device_memory.labels("reserved").set_function(lambda: torch.cuda.memory_reserved(device))

    def watch_cuda_graphs(self, graphs) -> None:
        """Export a model.graphs.CudaGraphs' counters at scrape time (the embedder has none on the CPU or with
        graphs off; the families then read 0, so dashboards and alerts see the series either way)."""
        self.registry.register(_GraphCollector(graphs))

    def set_backends(self, choices: dict[str, str], fused: bool) -> None:
        self.backend_info.clear()
        for op, backend in choices.items():
            self.backend_info.labels(op, backend).set(1)
        self.fused_enabled.set(1 if fused else 0)


class _GraphCollector:
    """fusedserve_cuda_graphs (held) and the capture / replay / eager-fallback counters of the CUDA-graph
    runner; capture thrash (captures rising under steady traffic) is what to watch."""

    def __init__(self, graphs) -> None:
        self.graphs = graphs

    def collect(self):
        stats = self.graphs.stats() if self.graphs is not None else {}
        held = GaugeMetricFamily(PREFIX + "cuda_graphs", "CUDA graphs held (one per shape bucket)")
        held.add_metric([], stats.get("graphs", 0))
        pool = GaugeMetricFamily(PREFIX + "cuda_graph_pool_bytes", "Device memory the CUDA graphs hold")
        pool.add_metric([], stats.get("pool_bytes", 0))
        yield held
        yield pool
        for name, key, help_text in (
            ("cuda_graph_captures", "captures", "CUDA graphs captured (new shape buckets, or after eviction)"),
            ("cuda_graph_replays", "replays", "Batches served by replaying a CUDA graph"),
            ("cuda_graph_eager_fallbacks", "eager_fallbacks", "Batches outside every CUDA-graph bucket, run eagerly"),
        ):
            family = CounterMetricFamily(PREFIX + name, help_text)
            family.add_metric([], stats.get(key, 0))
            yield family
