"""The KServe v2 infer route's limits on what a body may make the server do: dims are int64 and not negative, a
shape's element count fits int64 and max_client_batch (checked before any tensor data is read), the JSON is
read as Triton's RapidJSON reads it (no integer past int64, no NaN or Infinity, no key twice in an object), echoes
are short, and Content-Encoding is matched case-insensitively. The hostile bodies are answered within 100 ms of
their last byte while /healthz keeps answering; the checks behind them are also timed directly. Token-id inputs are
read as the gRPC service reads them (server.kserve_common): JSON numbers or raw bytes, each binary input's bytes
after the previous one's, refused from the shape before their data is read."""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
import zlib

import httpx
import numpy as np
import orjson
import pytest

from fusedserve.server.errors import BadRequest, PayloadTooLarge, clipped
from fusedserve.server.routes import kserve
from fusedserve.server.kserve_common import deserialize_bytes, element_count
from fusedserve.server.routes.kserve import parse_infer
from tests.server.conftest import start_server

LIMIT = 256  # max_client_batch's default
BUDGET_S = 0.1  # the brief's bound: from the body's last byte to the status line, and /healthz meanwhile
INT64_MAX = 2**63 - 1


def _infer_json(shape, data=None, parameters=None) -> dict:
    tensor = {"name": "text", "shape": shape, "datatype": "BYTES"}
    if data is not None:
        tensor["data"] = data
    if parameters is not None:
        tensor["parameters"] = parameters
    return {"inputs": [tensor]}


def _huge_dims() -> bytes:
    """1,000 dims of 4,000 digits each: about 4 MB, under max_body_bytes' 4 MiB default."""
    dims = ", ".join(["9" * 4000] * 1000)
    return b'{"inputs": [{"name": "text", "shape": [' + dims.encode() + b'], "datatype": "BYTES", "data": ["a"]}]}'


def _empty_elements(shape: list[int]) -> tuple[bytes, dict[str, str]]:
    """1,048,512 empty BYTES elements in the binary extension (each a zero 4-byte length): 4 MiB less 256 bytes."""
    data = b"\0" * (4 * 1_048_512)
    header = orjson.dumps(_infer_json(shape, parameters={"binary_data_size": len(data)}))
    return header + data, {"Inference-Header-Content-Length": str(len(header))}


# name, body, extra headers, status, a word the message must hold
HOSTILE = [
    ("1000 dims of 4000 digits", _huge_dims(), {}, 400, "int64"),
    ("negative dims", orjson.dumps(_infer_json([-1, -2], ["a", "b"])), {}, 400, "negative"),
    ("element count past int64", orjson.dumps(_infer_json([2**32, 2**32], ["a"])), {}, 400, "int64"),
    ("1048512 empty BYTES elements", *_empty_elements([1_048_512]), 413, "max_client_batch"),
    ("1048512 empty BYTES elements under shape [1]", *_empty_elements([1]), 413, "max_client_batch"),
]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("kserve-limits"), model="tiny", warmup=False)
    server.name = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    yield server
    server.stop()


def _request(server, body: bytes, headers: dict[str, str]) -> bytes:
    lines = [f"POST /v2/models/{server.name}/infer HTTP/1.1", "Host: 127.0.0.1", "Connection: close",
             f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _timed(server, request: bytes, timeout: float = 30) -> tuple[bytes, float]:
    """The whole answer, and the seconds from the request's last byte handed to the kernel to the answer's first
    byte (loopback: the server has the bytes as soon as it reads them)."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(request)
        sent = time.perf_counter()
        first = sock.recv(65536)
        answered = time.perf_counter()
        chunks = [first]
        while data := sock.recv(65536):
            chunks.append(data)
    return b"".join(chunks), answered - sent


class HealthPoller:
    """GET /healthz back to back on its own keep-alive connection while a test runs (its first answer, which opens
    the connection, is awaited and not timed); the slowest answer is kept."""

    def __init__(self, server) -> None:
        self.url, self.slowest, self.count = server.url + "/healthz", 0.0, 0
        self.ready, self.stop = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            client.get(self.url)
            self.ready.set()
            while not self.stop.is_set():
                started = time.perf_counter()
                assert client.get(self.url).status_code == 200
                self.slowest = max(self.slowest, time.perf_counter() - started)
                self.count += 1
                time.sleep(0.005)

    def wait_for(self, count: int) -> None:
        deadline = time.monotonic() + 30
        while self.count < count and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)

    def __enter__(self) -> HealthPoller:
        self.thread.start()
        assert self.ready.wait(timeout=30)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


@pytest.mark.parametrize("name,body,headers,status,word", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_a_hostile_body_is_refused_fast_while_healthz_answers(srv, name, body, headers, status, word):
    """Up to three tries, the best counting: each hostile body costs the server a few milliseconds, and a 2-core
    machine shared with other test runs can stall any one request for longer than the bound."""
    request = _request(srv, body, headers)
    tries = []
    for _ in range(3):
        with HealthPoller(srv) as health:
            answer, elapsed = _timed(srv, request)
            health.wait_for(health.count + 2)  # polls that overlap the answer, or follow it
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert int(head.split(b" ", 2)[1]) == status, answer[:300]
        message = orjson.loads(payload)["error"]
        assert isinstance(message, str) and word in message and len(message) < 300, message
        assert health.count > 0
        tries.append((elapsed, health.slowest))
        if elapsed < BUDGET_S and health.slowest < BUDGET_S:
            break
    assert min(e for e, _ in tries) < BUDGET_S and min(h for _, h in tries) < BUDGET_S, tries
    assert httpx.post(srv.url + f"/v2/models/{srv.name}/infer", json=_infer_json([1], ["still serving"]),
                      timeout=60).status_code == 200


@pytest.mark.parametrize("name,body,headers,status,word", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_the_checks_behind_them_take_milliseconds(name, body, headers, status, word):
    """The server-side cost of each refusal, without HTTP: a bound of 50 ms, where it takes a few."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        with pytest.raises((BadRequest, PayloadTooLarge)) as caught:
            parse_infer(body, headers.get("Inference-Header-Content-Length"), LIMIT)
        best = min(best, time.perf_counter() - started)
    assert caught.value.status == status and word in caught.value.message and len(caught.value.message) < 300
    assert best < 0.05, best


def test_element_count():
    assert element_count("text", [3, 4]) == 12
    assert element_count("text", []) == 1
    assert element_count("text", [2**40, 2**40, 0]) == 0  # a zero dim: no elements, whatever the others
    assert element_count("text", [INT64_MAX]) == INT64_MAX
    with pytest.raises(BadRequest, match="negative"):
        element_count("text", [4, -1])
    with pytest.raises(BadRequest, match="negative"):
        element_count("text", [0, -1])
    with pytest.raises(BadRequest, match="int64"):
        element_count("text", [2**62, 2])
    with pytest.raises(BadRequest, match="int64"):
        element_count("text", [10**4000, 0])
    with pytest.raises(BadRequest) as caught:  # the echo is cut, and names the dims
        element_count("text", [-7] * 100_000)
    assert len(caught.value.message) < 300 and "100000 dims" in caught.value.message
    started = time.perf_counter()
    with pytest.raises(BadRequest, match="int64"):  # the product stops once past int64
        element_count("text", [2**62] * 1000)
    assert time.perf_counter() - started < 0.05


def test_deserialize_bytes_stops_past_max_items():
    assert deserialize_bytes(b"\x01\0\0\0a\x02\0\0\0bc", 2) == [b"a", b"bc"]
    assert deserialize_bytes(b"", 2) == []
    with pytest.raises(PayloadTooLarge, match="max_client_batch"):
        deserialize_bytes(b"\x01\0\0\0a\x02\0\0\0bc", 1)
    started = time.perf_counter()
    with pytest.raises(PayloadTooLarge, match="max_client_batch"):
        deserialize_bytes(b"\0" * (4 * 1_048_512), LIMIT)
    assert time.perf_counter() - started < 0.05
    with pytest.raises(BadRequest, match="ends inside"):
        deserialize_bytes(b"\x05\0\0\0ab", 2)


def test_integers_are_int64():
    for value in (INT64_MAX, -INT64_MAX - 1, 0):
        body = orjson.dumps({**_infer_json([1], ["a"]), "parameters": {"x": value}})
        assert parse_infer(body, None, LIMIT)[1] == ["a"]
    for literal in (str(INT64_MAX + 1), str(-INT64_MAX - 2), "1" + "0" * 30):
        body = b'{"parameters": {"x": ' + literal.encode() + b'}, "inputs": []}'
        with pytest.raises(BadRequest, match="past int64"):
            parse_infer(body, None, LIMIT)


def _binary_body(*tensors: tuple[str, str, list[int], bytes]) -> tuple[bytes, str]:
    """A binary-extension body: (name, datatype, shape, raw bytes) per input, the bytes after the JSON in order."""
    header = orjson.dumps({"inputs": [{"name": name, "datatype": datatype, "shape": shape,
                                       "parameters": {"binary_data_size": len(raw)}}
                                      for name, datatype, shape, raw in tensors]})
    return header + b"".join(raw for *_, raw in tensors), str(len(header))


def test_token_ids_are_read_from_json_and_binary_data():
    ids = np.array([[101, 7, 8, 102], [101, 9, 102, 0]], dtype=np.int64)
    mask = (ids != 0).astype(np.int64)
    rows = [[101, 7, 8, 102], [101, 9, 102]]
    body = orjson.dumps({"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [2, 4], "data": ids.tolist()},
                                    {"name": "attention_mask", "datatype": "INT64", "shape": [2, 4],
                                     "data": mask.ravel().tolist()}]})
    assert parse_infer(body, None, LIMIT)[1] == rows
    for dtype, datatype in ((np.int64, "INT64"), (np.int32, "INT32")):
        raw, length = _binary_body(("input_ids", datatype, [2, 4], ids.astype(dtype).tobytes()),
                                   ("attention_mask", datatype, [2, 4], mask.astype(dtype).tobytes()))
        assert parse_infer(raw, length, LIMIT)[1] == rows
    raw, length = _binary_body(("input_ids", "INT64", [4], ids[0].tobytes()))  # [L]: one row
    assert parse_infer(raw, length, LIMIT)[1] == rows[:1]
    # the second input's size past what is left after the first's bytes
    raw, length = _binary_body(("input_ids", "INT64", [2, 4], ids.tobytes()), ("attention_mask", "INT64", [2, 4], b""))
    header = orjson.loads(raw[: int(length)])
    header["inputs"][1]["parameters"]["binary_data_size"] = 8
    header = orjson.dumps(header)
    with pytest.raises(BadRequest, match="'attention_mask' does not fit the 0 bytes left"):
        parse_infer(header + ids.tobytes(), str(len(header)), LIMIT)


@pytest.mark.parametrize("tensors,error,word", [
    ([("input_ids", "INT64", [LIMIT + 1, 1], b"\0" * 8 * (LIMIT + 1))], PayloadTooLarge, "max_client_batch"),
    ([("input_ids", "INT64", [1, 2**62], b"\0" * 8)], BadRequest, "raw bytes"),
    ([("input_ids", "INT64", [2**32, 2**32], b"")], BadRequest, "int64"),
    ([("input_ids", "INT64", [1, 0], b"")], BadRequest, "no token ids"),
    ([("input_ids", "INT64", [1, 3], b"\0" * 8)], BadRequest, "raw bytes"),
    ([("input_ids", "FP32", [1, 2], b"\0" * 8)], BadRequest, "INT64 or INT32"),
    ([("input_ids", "INT64", [1, 1], b"\0" * 8), ("logits", "FP32", [1], b"\0" * 4)], BadRequest, "'logits'"),
    ([("tokens", "INT64", [1, 1], b"\0" * 8)], BadRequest, "'tokens'"),
], ids=["rows past max_client_batch", "L past the data", "count past int64", "empty", "bytes short", "FP32",
        "an extra input", "another name"])
def test_bad_token_ids_are_refused_before_their_data_is_read(tensors, error, word):
    raw, length = _binary_body(*tensors)
    started = time.perf_counter()
    with pytest.raises(error) as caught:
        parse_infer(raw, length, LIMIT)
    assert word in caught.value.message and len(caught.value.message) < 300, caught.value.message
    assert time.perf_counter() - started < 0.05


def test_a_normal_body_stays_fast():
    """A KServe body is a few objects and a list of strings: its parse stays well under a millisecond per 100 KB
    (bound with a wide margin for a loaded machine)."""
    texts = ["The quick brown fox jumps over the lazy dog. " * 10 + str(i) for i in range(256)]
    body = orjson.dumps({"id": "r", **_infer_json([256], texts),
                         "outputs": [{"name": "embedding", "parameters": {"binary_data": True}}]})
    best = float("inf")
    for _ in range(20):
        started = time.perf_counter()
        assert parse_infer(body, None, LIMIT)[1] == texts
        best = min(best, time.perf_counter() - started)
    assert best < 0.01, best


def test_clipped():
    assert clipped("short") == "short"
    long = clipped("x" * 5000)
    assert long.startswith("x" * 100) and long.endswith("... (5000 characters)") and len(long) < 130


def _post(srv, body: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(srv.url + f"/v2/models/{srv.name}/infer", content=body, headers=headers or {}, timeout=60)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_or_infinity_in_an_ignored_field_is_a_400(srv, constant):
    good = orjson.dumps(_infer_json([1], ["a"]))
    body = b'{"parameters": {"ignored": ' + constant.encode() + b"}, " + good[1:]
    r = _post(srv, body)
    assert r.status_code == 400 and constant in r.json()["error"], r.text
    r = _post(srv, b'{"parameters": {"ignored": 1e999}, ' + good[1:])  # past float64: read as Infinity
    assert r.status_code == 400 and "1e999" in r.json()["error"], r.text


@pytest.mark.parametrize("body,key", [
    (b'{"inputs": [], "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["a"]}]}', "inputs"),
    (b'{"inputs": [{"name": "text", "shape": [1], "shape": [1], "datatype": "BYTES", "data": ["a"]}]}', "shape"),
    (b'{"parameters": {"a": 1, "a": 1}, "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", '
     b'"data": ["a"]}]}', "a"),
], ids=["top level", "in an input", "in parameters"])
def test_a_duplicate_key_is_a_400(srv, body, key):
    r = _post(srv, body)
    assert r.status_code == 400 and f"'{key}'" in r.json()["error"] and "twice" in r.json()["error"], r.text


@pytest.mark.parametrize("encoding", ["GZIP", " Gzip ", "DEFLATE"])
def test_content_encoding_is_case_insensitive(srv, encoding):
    raw = orjson.dumps(_infer_json([2], ["a", "b"]))
    body = gzip.compress(raw) if "gzip" in encoding.lower() else zlib.compress(raw)
    answer, _ = _timed(srv, _request(srv, body, {"Content-Encoding": encoding}))  # raw: httpx refuses the spaces
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and orjson.loads(payload)["outputs"][0]["shape"][0] == 2, answer[:300]


def test_schema_problems_stay_422_and_echoes_are_short(srv):
    for shape in (["a"], [1.5], [True]):
        assert _post(srv, orjson.dumps(_infer_json(shape, ["a"]))).status_code == 422
    assert _post(srv, b"[" * 10_000).status_code == 422
    assert _post(srv, b'{"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", '
                      b'"data": ["\\ud800"]}]}').status_code == 422  # a lone surrogate
    r = _post(srv, json.dumps({"parameters": {"normalize": "y" * 100_000}, **_infer_json([1], ["a"])}).encode())
    assert r.status_code == 400 and len(r.json()["error"]) < 300 and "100000 characters" in r.json()["error"]
    r = _post(srv, orjson.dumps(_infer_json([-1] * 10_000, ["a"])))
    assert r.status_code == 400 and len(r.json()["error"]) < 300, r.text
    r = _post(srv, orjson.dumps(_infer_json([2], ["a", "b", "c"])))
    assert r.status_code == 400 and "more than 2" in r.json()["error"], r.text
    ok = _post(srv, orjson.dumps(_infer_json([1, 2], [["a", "b"]])))  # nested data, flattened
    assert ok.status_code == 200 and ok.json()["outputs"][0]["shape"][0] == 2, ok.text


def test_a_large_body_is_read_off_the_event_loop(srv):
    """A body past OFF_LOOP_BYTES is parsed on a worker thread: a valid one is served as a small one is."""
    texts = ["word " * 60 + str(i) for i in range(LIMIT)]
    body = orjson.dumps(_infer_json([LIMIT], texts))
    assert len(body) > kserve.OFF_LOOP_BYTES
    r = _post(srv, body)
    assert r.status_code == 200 and r.json()["outputs"][0]["shape"][0] == LIMIT, r.text[:300]
    assert _post(srv, orjson.dumps(_infer_json([LIMIT + 1], texts + ["x"]))).status_code == 413
