"""One request, observed, on the real server: x-request-id (echoed or made), the timing headers (and that they
agree with the Prometheus metrics), OpenTelemetry spans exported over OTLP/HTTP to a collector run by this test
(continuing the caller's W3C traceparent, with tokenize / queue / forward children), and JSON log lines. Shutting
tracing down flushes the buffered spans to a live collector, and a collector that is down does not hold up the exit."""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
import signal
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from unittest import mock

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as trace_pb2

from fusedserve.server import tracing
from fusedserve.server.observability import CURRENT, JsonFormatter, RequestRecord
from tests.server.conftest import free_port, start_server

MODEL = "all-MiniLM-L6-v2"
TIMINGS = ("x-total-time", "x-tokenization-time", "x-queue-time", "x-inference-time")


class Collector:
    """An OTLP/HTTP trace receiver on 127.0.0.1: keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = trace_pb2.ExportTraceServiceRequest.FromString(body)
                with collector.lock:
                    for resource in request.resource_spans:
                        service = {a.key: a.value.string_value for a in resource.resource.attributes}
                        for scope in resource.scope_spans:
                            collector.spans.extend((service, span) for span in scope.spans)
                reply = trace_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def wait_for(self, trace_id: bytes, names: set[str], timeout_s: float = 20) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                found = {span.name: (service, span) for service, span in self.spans if span.trace_id == trace_id}
            if names <= set(found):
                return found
            time.sleep(0.1)
        raise AssertionError(f"spans {sorted(names)} of the trace not exported in time; got {sorted(found)}")


@pytest.fixture(scope="module")
def collector():
    c = Collector()
    yield c
    c.http.shutdown()


@pytest.fixture(scope="module")
def server(tmp_path_factory, collector):
    # the SDK's batch processor exports every 5 s by default; the test waits less
    with mock.patch.dict(os.environ, {"OTEL_BSP_SCHEDULE_DELAY": "100"}):
        srv = start_server(tmp_path_factory.mktemp("observed"), otlp_endpoint=collector.url,
                           otel_service_name="fusedserve-test", log_format="json")
    yield srv
    srv.stop()


def metric(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, flags=re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_request_id_is_echoed_or_made(server):
    r = httpx.post(server.url + "/infer", json={"inputs": "a"}, headers={"x-request-id": "client-42"}, timeout=60)
    assert r.headers["x-request-id"] == "client-42"
    made = httpx.post(server.url + "/infer", json={"inputs": "a"}, timeout=60).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made)
    odd = httpx.get(server.url + "/healthz", headers={"x-request-id": "no spaces allowed"}).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", odd)  # not echoed: it would land in logs and headers as given


@pytest.mark.parametrize("path,body", [
    ("/infer", {"inputs": ["one input"]}),
    ("/v1/embeddings", {"input": "one input"}),
    ("/embed", {"inputs": "one input"}),
    ("/v2/models/{name}/infer",
     {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["one input"]}]}),
])
def test_timing_headers_agree_with_the_metrics(server, path, body):
    route, path = path, path.format(name=MODEL)
    before = httpx.get(server.url + "/metrics").text
    r = httpx.post(server.url + path, json=body, timeout=60)
    after = httpx.get(server.url + "/metrics").text
    assert r.status_code == 200, r.text
    ms = {name: float(r.headers[name]) for name in TIMINGS}
    assert all(v >= 0 for v in ms.values())
    assert ms["x-total-time"] >= ms["x-tokenization-time"] + ms["x-queue-time"] + ms["x-inference-time"] - 0.01
    # one input: its wait in the queue is the one observation fusedserve_queue_duration_seconds got
    count, model = "fusedserve_queue_duration_seconds_count", f'{{model="{MODEL}"}}'
    assert metric(after, count, model) - metric(before, count, model) == 1
    queued = metric(after, "fusedserve_queue_duration_seconds_sum", model) - \
        metric(before, "fusedserve_queue_duration_seconds_sum", model)
    assert abs(queued * 1e3 - ms["x-queue-time"]) < 0.01
    # the request's duration is observed once the body is sent: the total-time header, plus that
    label = f'{{model="{MODEL}",route="{route}"}}'
    total = metric(after, "fusedserve_request_duration_seconds_sum", label) - \
        metric(before, "fusedserve_request_duration_seconds_sum", label)
    # (the gap is sending the body: small beside the request itself, however loaded the machine)
    assert 0 <= total * 1e3 - ms["x-total-time"] < max(50.0, ms["x-total-time"])


def test_spans_are_exported_with_the_callers_trace(server, collector):
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    r = httpx.post(server.url + "/infer", json={"inputs": ["traced", "twice"]}, timeout=60,
                   headers={"traceparent": f"00-{trace_id}-{parent_id}-01", "x-request-id": "traced-1"})
    assert r.status_code == 200
    spans = collector.wait_for(bytes.fromhex(trace_id), {"POST /infer", "tokenize", "queue", "forward"})
    service, root = spans["POST /infer"]
    assert service["service.name"] == "fusedserve-test"
    assert root.parent_span_id == bytes.fromhex(parent_id) and root.kind == root.SPAN_KIND_SERVER
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes["http.route"].string_value == "/infer"
    assert attributes["http.response.status_code"].int_value == 200
    assert attributes["fusedserve.request_id"].string_value == "traced-1"
    assert attributes["fusedserve.model"].string_value == MODEL
    for name in ("tokenize", "queue", "forward"):
        _, child = spans[name]
        assert child.parent_span_id == root.span_id
        assert root.start_time_unix_nano <= child.start_time_unix_nano <= child.end_time_unix_nano <= \
            root.end_time_unix_nano + 1_000_000
    assert spans["queue"][1].end_time_unix_nano <= spans["forward"][1].start_time_unix_nano + 1_000_000


def test_shutdown_flushes_the_buffered_spans_to_a_live_collector(collector):
    traced = tracing.Tracing(collector.url, "fusedserve-flush-test", "0")
    now = time.monotonic()
    span = traced.start_request("POST", "/infer", {}, now)
    traced.end_request(span, "/infer", 200, "flush-1")
    trace_id = span.get_span_context().trace_id.to_bytes(16, "big")
    # the batch processor's schedule delay (5 s by default) has not come: only shutdown's flush can send it, and a
    # collector on this machine answers well inside the time given (the default bound is for a dead one)
    traced.shutdown(timeout_s=30)
    with collector.lock:
        assert any(s.trace_id == trace_id for _, s in collector.spans), "shutdown dropped a span a live collector takes"


# Stopping a server with nothing to export takes well under this; a collector that is down made the SDK's exporter
# retry with back-off (1 s, 2 s, 4 s, ...) for longer than this before shutdown was bounded.
EXIT_DEADLINE_S = tracing.SHUTDOWN_FLUSH_S + 3.0


def test_a_collector_that_is_down_does_not_hold_up_shutdown(tmp_path):
    closed_port = free_port()  # nothing listens there: every export is refused and retried
    srv = start_server(tmp_path, otlp_endpoint=f"http://127.0.0.1:{closed_port}")
    try:
        r = httpx.post(srv.url + "/infer", json={"inputs": ["a span to export"]}, timeout=60)
        assert r.status_code == 200, r.text
        srv.process.send_signal(signal.SIGTERM)
        try:
            srv.process.wait(timeout=EXIT_DEADLINE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server took over {EXIT_DEADLINE_S:g} s to exit after SIGTERM with its collector down:\n"
                        + srv.log()[-3000:])
    finally:
        srv.stop()
    # the exit was prompt because the flush was cut short, not because there was nothing to send
    assert "did not take the last spans" in srv.log()


def test_logs_are_json(server):
    lines = [line for line in server.log().splitlines() if line.startswith("{")]
    entries = [json.loads(line) for line in lines]
    assert any(e["message"].startswith("ready in ") and e["logger"] == "fusedserve" for e in entries)
    assert all({"time", "level", "logger", "message"} <= set(e) for e in entries)
    assert {e["level"] for e in entries} <= {"debug", "info", "warning", "error", "critical"}


def test_a_json_log_line_carries_the_request_id():
    record = logging.LogRecord("fusedserve", logging.WARNING, __file__, 1, "something %s", ("odd",), None)
    token = CURRENT.set(RequestRecord("req-7", time.monotonic()))
    try:
        entry = json.loads(JsonFormatter().format(record))
    finally:
        CURRENT.reset(token)
    assert entry["request_id"] == "req-7" and entry["message"] == "something odd" and entry["logger"] == "fusedserve"


def test_a_throttle_allows_each_kind_once_per_interval(monkeypatch):
    from fusedserve.server import observability

    clock = [100.0]
    monkeypatch.setattr(observability.time, "monotonic", lambda: clock[0])
    throttle = observability.Throttle(60.0)
    assert throttle.allow("capture") and throttle.allow("timing")  # each kind's first time
    assert not throttle.allow("capture")
    clock[0] += 59.9
    assert not throttle.allow("capture")
    clock[0] += 0.1
    assert throttle.allow("capture") and throttle.allow("timing")  # a minute on: each kind again
