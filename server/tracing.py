"""Opt-in OpenTelemetry tracing (FUSEDSERVE_OTLP_ENDPOINT): a server span per HTTP request, continuing the
caller's trace from its W3C `traceparent` header, with child spans for tokenize, queue and forward. Spans are
exported in batches over OTLP/HTTP (protobuf) by the OpenTelemetry SDK, off the request path.

The batcher's worker runs forwards for many requests at once, so the queue and forward spans are not opened on
that thread: each request's spans are written after the fact from the times the batcher stamps on its job.
Each app owns its TracerProvider (nothing global is set), so tests may run several apps in one process."""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("fusedserve")


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
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name,
                                                                 "service.version": version}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
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

    def shutdown(self) -> None:
        """Export what is buffered, then stop the exporter thread."""
        self.provider.shutdown()
