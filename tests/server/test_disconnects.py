"""Clients that go away before their answer, as a client that gives up does: a TCP reset (SO_LINGER 0, then close)
while the request's body is being read, while its inputs wait for the batcher, or while its answer is being made.
On every HTTP route each is counted under status 499 (nginx's "client closed request"; gRPC counts the same), logged
once at INFO with no traceback, and its inputs still waiting are dropped before they run. Raw sockets: an HTTP client
neither resets a connection on purpose nor says when the server has begun reading a body (`Expect: 100-continue`
does: uvicorn answers "100 Continue" once the app first asks for the body, so a reset after it meets a request the
server has begun)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import socket
import struct
import time
from collections import Counter

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.model import checkpoints
from tests.server.conftest import admin_headers, start_server
from tests.server.test_behaviour import SLOW_OP

QUEUED, BATCHES_STARTED, INPUTS_STARTED = ("fusedserve_queue_depth", "fusedserve_batch_size_count",
                                           "fusedserve_queue_duration_seconds_count")
GONE = "client disconnected"
# how many clients the acceptance test resets (the finding's count; fewer where FUSEDSERVE_TEST_DISCONNECTS says)
DISCONNECTS = int(os.environ.get("FUSEDSERVE_TEST_DISCONNECTS", "4000"))


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """A server of an embedding model and a re-ranker, both tiny, with the test-only fault hooks."""
    ce = checkpoints.cross_encoder(tmp_path_factory.mktemp("ce") / "reranker", 1, "roberta")
    server = start_server(tmp_path_factory.mktemp("server"), faults=True, models=f"tiny=tiny,ce={ce}",
                          max_batch_requests=1, max_wait_ms=0, request_timeout_s=120)
    yield server
    server.stop()


def _kserve_binary(text: str) -> tuple[bytes, dict]:
    data = text.encode()
    header = json.dumps({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": 4 + len(data)}}]}).encode()
    return header + struct.pack("<I", len(data)) + data, {"Inference-Header-Content-Length": str(len(header))}


def _kserve_json(text: str) -> dict:
    return {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [text]}]}


# (path, the model it reaches, inputs it queues, a body or (bytes, headers)): the routes through a batcher's queue
QUEUED_ROUTES = [
    ("/infer", "tiny", 1, {"inputs": ["waits"]}),
    ("/v1/embeddings", "tiny", 1, {"input": "waits"}),
    ("/embed", "tiny", 1, {"inputs": "waits"}),
    ("/", "tiny", 1, {"inputs": "waits"}),
    ("/similarity", "tiny", 2, {"inputs": {"source_sentence": "waits", "sentences": ["too"]}}),
    ("/v2/models/tiny/infer", "tiny", 1, _kserve_json("waits")),
    ("/v2/models/tiny/infer", "tiny", 1, _kserve_binary("waits")),  # the binary extension
    ("/rerank", "ce", 1, {"query": "q", "texts": ["waits"]}),
    ("/v1/rerank", "ce", 1, {"query": "q", "documents": ["waits"]}),
    ("/predict", "ce", 1, {"inputs": "waits"}),
]
# every HTTP POST route that reads a body, with a valid request
EVERY_ROUTE = [
    *((path, body) for path, _, _, body in QUEUED_ROUTES),
    ("/embed_all", {"inputs": "waits"}),
    ("/embed_sparse", {"inputs": "waits"}),  # a 422 here (no sparse model), had its body arrived
    ("/tokenize", {"inputs": "waits"}),
    ("/decode", {"ids": [101, 102]}),
]


def _label(path: str) -> str:
    """The route label of fusedserve_requests_total for a path."""
    return re.sub(r"^/v2/models/[^/]+/infer$", "/v2/models/{name}/infer", path)


def _body(spec) -> tuple[bytes, dict]:
    return spec if isinstance(spec, tuple) else (json.dumps(spec).encode(), {"Content-Type": "application/json"})


def _address(server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def _begin(server, path: str, body: bytes, headers: dict) -> socket.socket:
    """A connection whose request's headers are sent and whose body the server has begun to read."""
    sock = socket.create_connection(_address(server), timeout=30)
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}", "Expect: 100-continue",
             *(f"{k}: {v}" for k, v in headers.items())]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
    answer = b""
    while not answer.endswith(b"\r\n\r\n"):
        chunk = sock.recv(1024)
        assert chunk, f"{path}: closed before 100 Continue"
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 100 "), answer
    return sock


def _reset(sock: socket.socket) -> None:
    """Close with a TCP reset, as a client that gives up (or dies) does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _metrics(server) -> list[tuple[str, dict, float]]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def _sum(samples, name: str, **labels) -> float:
    return sum(v for n, ls, v in samples if n == name and all(ls.get(k) == str(w) for k, w in labels.items()))


def _requests(samples, **labels) -> float:
    return _sum(samples, "fusedserve_requests_total", **labels)


def _wait(server, check, what: str, timeout: float = 60) -> list:
    deadline = time.monotonic() + timeout
    while not check(samples := _metrics(server)):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return samples


def _stall(server, model: str, seconds: float) -> None:
    r = httpx.post(server.url + "/admin/faults", json={"op": SLOW_OP, "mode": "delay", "factor": seconds,
                                                      "model": model}, headers=admin_headers(), timeout=30)
    assert r.status_code == 200, r.text


def _check_log(text: str, gone: int) -> None:
    """`gone` INFO lines for as many disconnects, and nothing else said about them: no error, no traceback."""
    lines = text.splitlines()
    said = [line for line in lines if GONE in line]
    assert len(said) == gone and all(" INFO " in line for line in said), said
    assert "Exception in ASGI application" not in text and "Traceback" not in text, text[-3000:]
    assert not [line for line in lines if " ERROR " in line or line.startswith("ERROR:")], text[-3000:]


def test_inputs_of_clients_that_reset_while_they_wait_never_run_on_every_queued_route(both):
    """Each model's batcher stalled on a first request; one request per route queued behind it and reset; once the
    stall ends, each batcher's next batch is the next request: the reset inputs were dropped, never run."""
    log_from = len(both.log())
    before = _metrics(both)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        holders = []
        for model, route in (("tiny", "/infer"), ("ce", "/predict")):
            _stall(both, model, 5.0)
            holders.append(pool.submit(httpx.post, both.url + route, json={"inputs": "occupies the worker"},
                                       timeout=60))
        _wait(both, lambda s: all(_sum(s, BATCHES_STARTED, model=m) > _sum(before, BATCHES_STARTED, model=m)
                                  for m in ("tiny", "ce")), "the holders' batches never started")
        socks, queued = [], Counter()
        for path, model, inputs, spec in QUEUED_ROUTES:
            body, headers = _body(spec)
            socks.append(_begin(both, path, body, headers))
            socks[-1].sendall(body)
            queued[model] += inputs
            _wait(both, lambda s: _sum(s, QUEUED, model=model) >= queued[model], f"{path}: not queued")
        body, headers = _body({"inputs": "waits"})
        socks.append(_begin(both, "/embed_all", body, headers))  # waits for the stalled batch, between batches
        socks[-1].sendall(body)
        for sock in socks:
            _reset(sock)
        after = _wait(both, lambda s: _requests(s, status=499) - _requests(before, status=499) >= len(socks),
                      "the resets were not all counted 499")
        for model in ("tiny", "ce"):
            assert _sum(after, "fusedserve_rejected_requests_total", model=model, reason="cancelled") - _sum(
                before, "fusedserve_rejected_requests_total", model=model, reason="cancelled") == \
                sum(1 for _, m, _, _ in QUEUED_ROUTES if m == model)
        assert httpx.delete(both.url + "/admin/faults", headers=admin_headers(), timeout=60).status_code == 200
        assert [h.result().status_code for h in holders] == [200, 200]
    assert httpx.post(both.url + "/infer", json={"inputs": ["after"]}, timeout=60).status_code == 200
    assert httpx.post(both.url + "/predict", json={"inputs": "after"}, timeout=60).status_code == 200
    after = _metrics(both)
    for model in ("tiny", "ce"):  # the holder's batch and the one after it: none of the reset inputs ran
        assert _sum(after, BATCHES_STARTED, model=model) - _sum(before, BATCHES_STARTED, model=model) == 2, model
        assert _sum(after, INPUTS_STARTED, model=model) - _sum(before, INPUTS_STARTED, model=model) == 2, model
    for label, count in Counter(_label(path) for path, *_ in [*QUEUED_ROUTES, ("/embed_all",)]).items():
        assert _requests(after, route=label, status=499) - _requests(before, route=label, status=499) == count, label
    assert _requests(after, status=499) - _requests(before, status=499) == len(socks)
    assert _requests(after, status=500) == 0
    _check_log(both.log()[log_from:], len(socks))


def test_a_client_that_resets_while_sending_its_body_is_a_499_on_every_route(both):
    log_from = len(both.log())
    before = _metrics(both)
    expected = Counter()
    for path, spec in EVERY_ROUTE:
        body, headers = _body(spec)
        sock = _begin(both, path, body, headers)
        sock.sendall(body[: len(body) // 2])
        _reset(sock)
        label = _label(path)
        expected[label] += 1
        _wait(both, lambda s: _requests(s, route=label, status=499) - _requests(before, route=label, status=499)
              >= expected[label], f"{path}: not counted 499")
    after = _metrics(both)
    assert _requests(after, status=499) - _requests(before, status=499) == len(EVERY_ROUTE)
    assert _requests(after, status=500) == 0 and _requests(after, status=400) == _requests(before, status=400)
    _check_log(both.log()[log_from:], len(EVERY_ROUTE))


def test_a_client_that_resets_while_its_answer_is_made_is_a_499(both):
    """A long text to /tokenize: its tokens take far longer to make than the reset takes to arrive, and the answer
    (413: more tokens than one answer may hold) goes nowhere. The body stays under uvicorn's read-ahead limit (64
    KiB), past which uvicorn stops reading the connection, and so sees no reset, until the app asks for more."""
    log_from = len(both.log())
    before = _metrics(both)
    body = json.dumps({"inputs": "a " * 30_000}).encode()
    sock = _begin(both, "/tokenize", body, {"Content-Type": "application/json"})
    sock.sendall(body)
    _reset(sock)
    after = _wait(both, lambda s: _requests(s, route="/tokenize") > _requests(before, route="/tokenize"),
                  "/tokenize: not counted")
    assert _requests(after, route="/tokenize", status=499) - _requests(before, route="/tokenize", status=499) == 1
    _check_log(both.log()[log_from:], 1)


@pytest.mark.slow
def test_thousands_of_resets_are_499s_with_one_info_line_each(make_server):
    """The finding's scale: DISCONNECTS clients reset while their inputs wait, a wave of them at a time. None is a
    500; the log holds one INFO line per reset and no traceback."""
    server = make_server(faults=True, max_batch_requests=1, max_wait_ms=0, max_queue=DISCONNECTS + 64,
                         request_timeout_s=600)
    _stall(server, None, 600.0)  # the holder's batch outlasts the test: the server is killed at its end
    holder = socket.create_connection(_address(server), timeout=30)
    body = b'{"inputs": ["occupies the worker"]}'
    holder.sendall(b"POST /infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                   % (len(body), body))
    try:
        _wait(server, lambda s: _sum(s, BATCHES_STARTED) >= 1, "the holder's batch never started")
        log_from = len(server.log())
        started = time.monotonic()
        request, wave = b'{"inputs": ["waits, then its client resets"]}', 250
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            for first in range(0, DISCONNECTS, wave):
                count = min(wave, DISCONNECTS - first)
                socks = list(pool.map(lambda _: _begin(server, "/infer", request,
                                                       {"Content-Type": "application/json"}), range(count)))
                for sock in socks:
                    sock.sendall(request)
                _wait(server, lambda s: _sum(s, QUEUED) >= first + count, "not all queued", timeout=120)
                for sock in socks:
                    _reset(sock)
        samples = _wait(server, lambda s: _requests(s, status=499) >= DISCONNECTS, "not all counted 499",
                        timeout=120)
        elapsed = time.monotonic() - started
        assert _requests(samples, status=499) == DISCONNECTS and _requests(samples, status=500) == 0
        assert _sum(samples, "fusedserve_rejected_requests_total", reason="cancelled") == DISCONNECTS
        _check_log(server.log()[log_from:], DISCONNECTS)
        print(f"{DISCONNECTS} resets in {elapsed:.1f}s")
    finally:
        holder.close()
        server.process.kill()
