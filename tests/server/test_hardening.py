"""What a hostile or careless client can do to the server, at the protocol level: headers, bodies that never
finish or never stop, duplicate credentials, oversized echoes, and the memory one request may cost. Raw sockets
where an HTTP client would refuse to send the request."""

from __future__ import annotations

import concurrent.futures
import json
import random
import resource
import socket
import time
from pathlib import Path

import httpx
import pytest

from fusedserve.server import heap
from tests.model import checkpoints
from tests.server.conftest import admin_headers
from tests.waiting import wait_until

NAME = "all-MiniLM-L6-v2"


def _raw(server, request: bytes, pause_after: int | None = None, pause_s: float = 0.0, timeout: float = 30) -> bytes:
    """Send `request` over a fresh connection (optionally stopping `pause_s` after its first `pause_after`
    bytes) and return the whole answer."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        if pause_after is not None:
            sock.sendall(request[:pause_after])
            time.sleep(pause_s)  # a client slow on purpose: the behaviour under test
            request = request[pause_after:]
        try:
            sock.sendall(request)
        except OSError:  # the server answered and closed before reading it all
            pass
        chunks = []
        while data := sock.recv(65536):
            chunks.append(data)
    return b"".join(chunks)


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def _post(path: str, body: bytes, headers: list[tuple[str, str]] = ()) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json", "Connection: close",
             *(f"{k}: {v}" for k, v in headers)]
    if not any(k.lower() in ("content-length", "transfer-encoding") for k, _ in headers):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def test_a_numeric_header_of_non_ascii_digits_is_a_400_not_a_500(server):
    body = b'{"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["a"]}]}'
    answer = _raw(server, _post(f"/v2/models/{NAME}/infer", body,
                                [("Inference-Header-Content-Length", "\u00b2")]))  # one byte, 0xb2
    assert _status(answer) == 400 and b"Inference-Header-Content-Length" in answer, answer[:300]
    answer = _raw(server, _post("/infer", b'{"inputs": "a"}', [("Content-Length", "\u00b9\u00b5")]))
    assert _status(answer) == 400, answer[:300]


@pytest.mark.parametrize("path", ["/rerank", "/predict", "/v1/rerank", "/admin/fused", "/infer"])
def test_a_chunked_body_over_the_limit_is_a_413_on_every_route(make_server, path):
    srv = make_server(model="tiny", warmup=False, max_body_bytes=4096)
    chunk = b"x" * 1000
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(8)) + b"0\r\n\r\n"
    headers = [("Transfer-Encoding", "chunked"), *admin_headers().items()]
    answer = _raw(srv, _post(path, chunked, headers))
    assert _status(answer) == 413, answer[:300]


def test_duplicate_authorization_headers_are_refused_by_both_checks(make_server):
    srv = make_server(model="tiny", warmup=False, api_keys="key-a")
    good, other = ("Authorization", "Bearer key-a"), ("Authorization", "Bearer nope")
    assert _status(_raw(srv, _post("/infer", b'{"inputs": "a"}', [good]))) == 200
    for pair in ([good, other], [other, good]):
        assert _status(_raw(srv, _post("/infer", b'{"inputs": "a"}', pair))) == 400
        admin = [(k, v) for k, v in admin_headers().items()]
        assert _status(_raw(srv, _post("/admin/fused", b'{"enabled": true}', [*admin, *pair]))) == 400


def test_headers_beyond_their_limits_are_a_431(server):
    many = [(f"X-Filler-{i}", "v") for i in range(200)]
    assert _status(_raw(server, _post("/infer", b'{"inputs": "a"}', many))) == 431
    big = [("X-Filler", "v" * 40_000)]
    assert _status(_raw(server, _post("/infer", b'{"inputs": "a"}', big))) == 431
    assert httpx.post(server.url + "/infer", json={"inputs": "still serving"}, timeout=30).status_code == 200


def test_an_unknown_model_name_is_not_echoed_whole(server):
    name = "m" * 100_000
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "x", "model": name}, timeout=30)
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    assert len(message) < 1000 and "100000 characters" in message


def test_a_body_that_stops_half_way_gets_a_408_within_the_request_timeout(make_server):
    srv = make_server(model="tiny", warmup=False, request_timeout_s=1.5)
    request = _post("/infer", b'{"inputs": "a"}', [("Content-Length", "100")])
    started = time.monotonic()
    answer = _raw(srv, request, timeout=10)
    assert _status(answer) == 408 and b"not received within 1.5s" in answer, answer[:300]
    assert 1.4 < time.monotonic() - started < 5
    # a body that arrives within the time is served
    assert _status(_raw(srv, _post("/infer", b'{"inputs": "a"}'), pause_after=120, pause_s=0.3)) == 200


def _rss_mib(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} for {pid}")


# The heap trim after a large request (server.heap) is seen from outside only through its effect, the RSS falling. A
# fall of at least TRIM_FALL_MIB is the trim (an idle server's RSS moves by a few MiB); a request that left nothing to
# give back shows none, so without a fall within TRIM_QUIET_S of the trim coming due the RSS is taken as it is.
TRIM_FALL_MIB = 16
TRIM_QUIET_S = 2.0


def _rss_after_the_trim(pid: int, answered: float) -> float:
    """The idle RSS (MiB) once the heap freed by the request answered at `answered` (time.monotonic()) is given back:
    after a fall, once two reads in a row agree within 1 MiB."""
    quiet_after = answered + heap.TRIM_DELAY_S + TRIM_QUIET_S
    first, reads = _rss_mib(pid, "VmRSS"), []

    def settled() -> float | None:
        reads.append(_rss_mib(pid, "VmRSS"))
        if first - min(reads) >= TRIM_FALL_MIB:
            return reads[-1] if len(reads) >= 2 and abs(reads[-1] - reads[-2]) < 1 else None
        return reads[-1] if time.monotonic() > quiet_after else None

    return wait_until(settled, heap.TRIM_DELAY_S + TRIM_QUIET_S + 30,
                      lambda: f"the RSS kept falling after the trim: {[round(r) for r in reads[-10:]]} MiB", 0.1)


def test_the_largest_allowed_requests_cost_a_bounded_amount_of_memory(server):
    """One request may grow the process by at most 256 MiB (docs/operations.md, "Limits"): the largest text a request
    may send (max_request_chars) to the routes whose work or answer grows with it, each measured as the peak RSS
    during it (the kernel's peak reset before it) over the RSS before it; past the limit a 413 before tokenizing."""
    pid = server.process.pid
    assert httpx.post(server.url + "/infer", json={"inputs": ["warm " * 100]}, timeout=60).status_code == 200
    limit = 512 * 1024
    # each request's status: the text is taken whole (truncated to max_seq_length where it is embedded), except that
    # /tokenize, having tokenized it all, refuses an answer of more tokens than max_batch_tokens
    for path, body, status in [("/tokenize", {"inputs": "a " * (limit // 2)}, 413),
                               ("/infer", {"inputs": ["a " * (limit // 2)]}, 200),
                               ("/embed_all", {"inputs": "a " * (limit // 2)}, 200),
                               ("/infer", {"inputs": ["a " * (limit // 128)] * 64}, 200)]:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        before = _rss_mib(pid, "VmRSS")
        r = httpx.post(server.url + path, json=body, timeout=120)
        assert r.status_code == status, (path, r.status_code, r.text[:300])
        if status == 413:
            assert "per-token output is limited to" in r.json()["error"], r.text[:300]
        assert _rss_mib(pid, "VmHWM") - before < 256, (path, _rss_mib(pid, "VmHWM"), before)
        _rss_after_the_trim(pid, time.monotonic())  # the next request starts from the heap given back
    r = httpx.post(server.url + "/tokenize", json={"inputs": "a " * (limit // 2 + 1)}, timeout=120)
    assert r.status_code == 413 and "max_request_chars" in r.json()["error"]


def test_a_connection_that_never_finishes_its_headers_is_closed(make_server):
    srv = make_server(model="tiny", warmup=False, header_timeout_s=1.0)
    host, port = srv.url.removeprefix("http://").split(":")
    silent = socket.create_connection((host, int(port)), timeout=10)  # sends nothing at all
    half = socket.create_connection((host, int(port)), timeout=10)
    half.sendall(b"POST /infer HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")  # stops inside its headers
    started = time.monotonic()
    try:
        for sock in (silent, half):
            assert sock.recv(1024) == b""  # the server closed it
        assert 0.9 < time.monotonic() - started < 5
        # a keep-alive connection's second request gets the same deadline for its headers
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answer = b""
            while not answer.endswith(b'{"status":"ok"}'):  # the whole first answer
                answer += sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200")
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 1")
            assert sock.recv(65536) == b""
        # slow but in time is served
        assert _status(_raw(srv, _post("/infer", b'{"inputs": "a"}'), pause_after=20, pause_s=0.5)) == 200
    finally:
        silent.close()
        half.close()


def test_the_server_raises_its_open_files_limit_to_the_hard_limit(make_server):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # the server inherits a low soft limit
    try:
        srv = make_server(model="tiny", warmup=False)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    line = next(text for text in Path(f"/proc/{srv.process.pid}/limits").read_text().splitlines()
                if text.startswith("Max open files"))
    limits = line.split()[3:5]
    assert limits[0] == limits[1] or limits == [str(1 << 20), "unlimited"], line


def test_past_max_connections_the_probes_are_answered_and_other_requests_get_a_503(make_server):
    # idle_timeout_s: the held connections, kept alive after their probe, outlast the test
    srv = make_server(model="tiny", warmup=False, max_connections=3, idle_timeout_s=120)
    host, port = srv.url.removeprefix("http://").split(":")
    held = [socket.create_connection((host, int(port)), timeout=10) for _ in range(3)]  # the cap, idle
    try:
        for sock in held:  # each answers a probe, kept alive: the server's loop has accepted it
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while not answer.endswith(b'{"status":"ok"}'):  # the whole answer
                chunk = sock.recv(65536)
                assert chunk, f"closed before its answer: {answer[:300]!r}"
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        for path in ("/healthz", "/readyz", "/metrics"):
            assert _status(_raw(srv, f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())) == 200
        answer = _raw(srv, _post("/infer", b'{"inputs": "a"}'))  # the connection is closed after the answer
        head, _, body = answer.partition(b"\r\n\r\n")
        assert _status(answer) == 503 and b"retry-after: 1" in head.lower(), answer[:300]
        assert json.loads(body)["error"]["type"] == "overloaded"
        # a connection opened past the cap gets a short deadline for its headers
        late = socket.create_connection((host, int(port)), timeout=10)
        started = time.monotonic()
        assert late.recv(1024) == b"" and time.monotonic() - started < 5
        late.close()
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 15  # once the held connections are gone (or timed out), requests are served again
    while _status(_raw(srv, _post("/infer", b'{"inputs": "a"}'))) != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)


WORDS = "alpha beta gamma delta kernel fused batch token layer norm vector serve encoder".split()


def _texts(seed: int, count: int = 256, chars: int = 2048) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(chars // 4))[:chars] for _ in range(count)]


def _tokens(seed: int, count: int, words: int) -> list[str]:
    """`count` texts of exactly `words` + 2 tokens each (with [CLS] and [SEP]): single letters, each a token of
    MiniLM's vocabulary (the tiny model's too), so the body stays small and only the answer is large."""
    rng = random.Random(seed)
    return [" ".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(words)) for _ in range(count)]


def _kserve_binary(texts: list[str]) -> dict:
    data = b"".join(len(t.encode()).to_bytes(4, "little") + t.encode() for t in texts)
    header = json.dumps({"inputs": [{"name": "text", "shape": [len(texts)], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": len(data)}}]}).encode()
    return {"content": header + data, "headers": {"Inference-Header-Content-Length": str(len(header)),
                                                  "Content-Type": "application/octet-stream"}}


def _largest(route: str, seed: int, tokens: int, seq: int) -> tuple[str, dict]:
    """The largest request `route` takes (max_client_batch inputs, max_request_chars of text, max_batch_tokens of
    per-token answer, max_seq_length tokens a pair), as (path, httpx.post's keyword arguments)."""
    texts = _texts(seed)  # 256 inputs, 512 Ki characters in all
    per_token = _tokens(seed, tokens // seq, seq - 2)  # max_batch_tokens tokens in all, none cut
    kserve = {"inputs": [{"name": "text", "shape": [len(texts)], "datatype": "BYTES", "data": texts}]}
    query = texts[0][:48]
    requests = {
        "/infer": ("/infer", {"json": {"inputs": texts}}),
        "/v1/embeddings": ("/v1/embeddings", {"json": {"input": texts}}),
        "/embed": ("/embed", {"json": {"inputs": texts}}),
        "/similarity": ("/similarity", {"json": {"inputs": {"source_sentence": texts[0], "sentences": texts[1:]}}}),
        "/embed_all": ("/embed_all", {"json": {"inputs": per_token}}),
        "/tokenize": ("/tokenize", {"json": {"inputs": per_token}}),
        # the whole max_request_chars tokenized, then refused (413): more tokens than one answer may hold
        "/tokenize (413)": ("/tokenize", {"json": {"inputs": texts}}),
        "/decode": ("/decode", {"json": {"ids": [[1000 + (seed + i * j) % 28000 for j in range(seq)]
                                                  for i in range(tokens // seq)]}}),
        "/rerank": ("/rerank", {"json": {"query": query, "texts": [t[: 2048 - len(query)] for t in texts],
                                         "truncate": True}}),
        "/predict": ("/predict", {"json": {"inputs": [[query, t[: 2048 - len(query)]] for t in texts],
                                           "truncate": True}}),
        "/v2 JSON": ("/v2/models/tiny/infer", {"json": kserve}),
        "/v2 binary": ("/v2/models/tiny/infer", _kserve_binary(texts)),
    }
    return requests[route]


def _small(body: dict) -> dict:
    """The same request with one short input."""
    if "ids" in body:
        return {**body, "ids": [[101, 102]]}
    if "texts" in body:
        return {**body, "texts": ["a b"]}
    if "inputs" in body and isinstance(body["inputs"], dict):
        return {**body, "inputs": {"source_sentence": "a", "sentences": ["b"]}}
    if "inputs" in body and body["inputs"] and isinstance(body["inputs"][0], dict):
        return {"inputs": [{**body["inputs"][0], "shape": [1], "data": ["a b"]}]}
    if "inputs" in body:
        return {**body, "inputs": [["a", "b"]] if isinstance(body["inputs"][0], list) else ["a b"]}
    return {**body, "input": ["a b"]}


LARGEST_ROUTES = ("/infer", "/v1/embeddings", "/embed", "/similarity", "/embed_all", "/tokenize", "/tokenize (413)",
                  "/decode", "/rerank", "/predict", "/v2 JSON", "/v2 binary")


@pytest.mark.slow
def test_idle_memory_returns_within_ten_percent_after_bursts_of_the_largest_requests(make_server, tmp_path):
    """After bursts of the largest request of every HTTP route (four at once, twice), the idle process's RSS is back
    within 10% of what it was before them (#47's bound), route by route: freed heap and reference cycles are given
    back shortly after a large body or a large answer (server.heap; the per-token routes' largest requests are
    small bodies with large answers, the 413 leaves a traceback's cycle behind). An embedding model and a re-ranker,
    both tiny, with the product's limits (max_batch_tokens at its GPU default) and short inputs (max_seq_length), so
    the forwards stay short on a CPU while the text, the answers and the tokens are the largest allowed."""
    ce = checkpoints.cross_encoder(tmp_path / "ce", 1, "roberta")
    tokens, seq = 16384, 64
    srv = make_server(models=f"tiny=tiny,ce={ce}", warmup=False, request_timeout_s=300, max_batch_tokens=tokens,
                      max_seq_length=seq)
    pid = srv.process.pid

    def post(route: str, seed: int, small: bool = False) -> int:
        path, kwargs = _largest(route, seed, tokens, seq)
        if small:  # one of each first: thread pools and first-use state exist before `before` is measured
            kwargs = {**kwargs, "json": _small(kwargs["json"])} if "json" in kwargs else _kserve_binary(["a b"])
        return httpx.post(srv.url + path, timeout=300, **kwargs).status_code

    for route in LARGEST_ROUTES:
        assert post(route, 0, small=True) == 200, route
    before = _rss_after_the_trim(pid, time.monotonic())
    after: dict[str, float] = {}
    for route in LARGEST_ROUTES:
        for burst in range(2):
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                statuses = list(pool.map(lambda i: post(route, 10 * burst + i), range(4)))
            assert set(statuses) == ({413} if "413" in route else {200}), (route, statuses)
        deadline = time.monotonic() + 10  # idle: its heap is given back shortly after the burst
        while (rss := _rss_mib(pid, "VmRSS")) > 1.10 * before and time.monotonic() < deadline:
            time.sleep(0.2)
        after[route] = rss
    assert all(rss <= 1.10 * before for rss in after.values()), f"idle {before:.0f} MiB before the bursts; after " + \
        ", ".join(f"{route}'s: {rss - before:+.0f}" for route, rss in after.items())

