"""One request, observed: its id, where its time went, the response headers that say so, and JSON log lines that
carry the id.

The app's RequestObserver middleware opens a RequestRecord per request and puts it in a context variable; the
service adds what it measured (tokenization, time in the queue, inference) without being handed anything, so the
routes and the service's other callers (tests, benchmarks) stay as they are. The headers, in milliseconds:
`x-total-time` (from the first byte the app saw to the response start), `x-tokenization-time`, `x-queue-time`
(submission to the start of the first batch holding one of the request's inputs, as
`fusedserve_queue_duration_seconds` counts it), `x-inference-time` (from then until the last input's embedding
was delivered), and `x-request-id` (the client's, or a new one)."""

from __future__ import annotations

import contextvars
import itertools
import json
import logging
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

CURRENT: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar("fusedserve_request", default=None)

# a client's id is echoed only when it is short and plain (it lands in logs and headers)
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/+=@-]{1,128}$")

TIMING_HEADERS = ("x-request-id", "x-total-time", "x-tokenization-time", "x-queue-time", "x-inference-time")


# A new id: this process's random prefix and a counter, unique without a call per request that lets go of the GIL
# (uuid4 reads os.urandom, and the event loop could then wait for a busy batcher thread's switch interval)
_ID_PREFIX = uuid.uuid4().hex[:16]
_ID_COUNTER = itertools.count()


def request_id(given: str | None) -> str:
    return given if given and _REQUEST_ID.match(given) else f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


# what a request whose client went away before its answer is counted under: nginx's "client closed request" (gRPC
# counts its cancelled calls the same)
CLIENT_GONE_STATUS = 499


class ClientGone(Exception):
    """The request's client went away (its connection closed) before its answer. Not an error of the server: the
    app's RequestObserver counts it under CLIENT_GONE_STATUS, logs one INFO line, and answers nothing (there is
    nobody to read it). Raised where the service notices the disconnect; its inputs not run yet are dropped."""


@dataclass
class RequestRecord:
    id: str
    started: float  # time.monotonic()
    model: str = ""  # the model the request was routed to (Service.model), for its metrics and span
    tokenization_s: float | None = None
    queue_s: float | None = None
    inference_s: float | None = None
    span: Any = None  # the OpenTelemetry server span, when tracing is on
    tracing: Any = None  # server.tracing.Tracing
    spans: list[tuple[str, float, float, dict]] = field(default_factory=list)

    def tokenized(self, start: float, end: float, inputs: int) -> None:
        self.tokenization_s = (self.tokenization_s or 0.0) + (end - start)
        self._child("tokenize", start, end, {"fusedserve.inputs": inputs})

    def served(self, enqueued: float, started: float, done: float, inputs: int, tokens: int) -> None:
        """A job's stamps from the batcher: submitted, its first batch started, its last row delivered."""
        self.queue_s = (self.queue_s or 0.0) + (started - enqueued)
        self.inference_s = (self.inference_s or 0.0) + (done - started)
        self._child("queue", enqueued, started, {"fusedserve.inputs": inputs})
        self._child("forward", started, done, {"fusedserve.inputs": inputs, "fusedserve.tokens": tokens})

    def _child(self, name: str, start: float, end: float, attributes: dict) -> None:
        if self.span is not None:
            self.tracing.child(self.span, name, start, end, attributes)

    def headers(self, now: float) -> list[tuple[bytes, bytes]]:
        out = [(b"x-request-id", self.id.encode()), (b"x-total-time", _ms(now - self.started))]
        for name, value in ((b"x-tokenization-time", self.tokenization_s), (b"x-queue-time", self.queue_s),
                            (b"x-inference-time", self.inference_s)):
            if value is not None:
                out.append((name, _ms(value)))
        return out


def _ms(seconds: float) -> bytes:
    return f"{seconds * 1e3:.3f}".encode()


def now() -> float:
    return time.monotonic()


class Throttle:
    """For warnings about one kind of thing that may repeat: allow(kind) is True at most once per `seconds` per kind
    (the first time, then once the interval has passed). Not locked: two threads asking at once may both be allowed,
    which costs a repeated log line and nothing else."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._last: dict[str, float] = {}

    def allow(self, kind: str) -> bool:
        now = time.monotonic()
        if now - self._last.get(kind, -math.inf) < self.seconds:
            return False
        self._last[kind] = now
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the request id inside a request, and the
    traceback where there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        current = CURRENT.get()
        if current is not None:
            entry["request_id"] = current.id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str, fmt: str) -> None:
    """The root logger for `fusedserve serve`: text lines, or JSON objects (uvicorn's loggers then propagate to
    it instead of writing their own format)."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
