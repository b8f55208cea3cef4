"""Opt-in OpenTelemetry tracing (FUSEDSERVE_OTLP_ENDPOINT): a server span per HTTP request, continuing the
caller's trace from its W3C `traceparent` header, with child spans for tokenize, queue and forward. Spans are
exported in batches over OTLP/HTTP (protobuf) by the OpenTelemetry SDK, off the request path.

The batcher's worker runs forwards for many requests at once, so the queue and forward spans are not opened on
that thread: each request's spans are written after the fact from the times the batcher stamps on its job.
Each app owns its TracerProvider (nothing global is set), so tests may run several apps in one process."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger("fusedserve")

# How long shutdown waits for the buffered spans to reach the collector. A live collector takes a batch in a few
# milliseconds; one that is down or unreachable makes the SDK's exporter retry with back-off for seconds, which would
# hold up every exit (and a pod's termination) for spans that are lost anyway.
SHUTDOWN_FLUSH_S = 0.5


def epoch_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as nanoseconds since the epoch (what span timestamps are)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class Tracing:
    def __init__(self, endpoint: str, service_name: str, version: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        url = endpoint.rstrip("/")
        if not url.endswith("/v1/traces"):
            url += "/v1/traces"
        self.url = url
        # shutdown_on_exit=False: the service shuts tracing down itself, within SHUTDOWN_FLUSH_S; the SDK's exit
        # handler would wait on the exporter again, unbounded on some SDK releases
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name,
                                                                 "service.version": version}),
                                       shutdown_on_exit=False)
        self.exporter = OTLPSpanExporter(endpoint=url)
        self.provider.add_span_processor(BatchSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("fusedserve", version)
        self.propagator = TraceContextTextMapPropagator()
        self._server, self._internal = SpanKind.SERVER, SpanKind.INTERNAL
        self._status, self._error = Status, StatusCode.ERROR
        self._in_context = set_span_in_context
        log.info("tracing: spans go to %s", url)

    def start_request(self, method: str, path: str, headers: dict[str, str], start_s: float):
        """The server span of one request, a child of the caller's span when it sent a traceparent."""
        parent = self.propagator.extract(headers)
        return self.tracer.start_span(f"{method} {path}", context=parent, kind=self._server,
                                      start_time=epoch_ns(start_s),
                                      attributes={"http.request.method": method, "url.path": path})

    def end_request(self, span, route: str, status: int, request_id: str, model: str = "") -> None:
        span.update_name(f"{span.attributes.get('http.request.method', '')} {route}".strip())
        span.set_attribute("http.route", route)
        span.set_attribute("http.response.status_code", status)
        span.set_attribute("fusedserve.request_id", request_id)
        if model:
            span.set_attribute("fusedserve.model", model)
        if status >= 500:
            span.set_status(self._status(self._error))
        span.end()

    def child(self, parent, name: str, start_s: float, end_s: float, attributes: dict[str, Any] | None = None) -> None:
        """A finished child span of `parent` between two time.monotonic() readings."""
        span = self.tracer.start_span(name, context=self._in_context(parent), kind=self._internal,
                                      start_time=epoch_ns(start_s), attributes=attributes or {})
        span.end(end_time=epoch_ns(end_s))

    def shutdown(self, timeout_s: float = SHUTDOWN_FLUSH_S) -> None:
        """Export what is buffered, waiting at most `timeout_s`, and stop the exporter. Spans a collector that is down
        or slow did not take by then are dropped: the flush runs on a daemon thread, so the process exits without it."""
        flush = threading.Thread(target=self.provider.shutdown, name="fusedserve-tracing-shutdown", daemon=True)
        flush.start()
        flush.join(timeout_s)
        if flush.is_alive():
            log.warning("tracing: the collector at %s did not take the last spans within %.1fs; they are dropped",
                        self.url, timeout_s)
            # ends the exporter's retry back-off (it waits on the exporter's shutdown event) and closes its connections
            self.exporter.shutdown()
