"""FRONTENDS=2 on a real `fusedserve serve` (the CPU, the tiny preset): an engine process holds the model and two
front-end processes on the one port prepare, send and answer. Answers equal a single process's; front-ends load no
torch; one scrape counts every process; the admin switch reaches the engine and every front-end's /info; concurrent
clients each get their own rows. Faults: an engine killed under load fails only the requests in flight (503 with
Retry-After), readiness is false until its replacement is ready, and the answers after are right; a front-end
killed is started again while the other serves; the parent killed outright leaves no engine or front-end running."""

from __future__ import annotations

import base64
import concurrent.futures
import os
import signal
import socket
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.server.test_startup import _children, launch, stop, wait_ready
from tests.tolerances import assert_same_rows

pytestmark = pytest.mark.slow

TEXTS = [f"request {i}: front-ends hand their rows to one engine" for i in range(64)]
SETTINGS = dict(model="tiny", backend="torch", torch_threads=1, max_batch_tokens=512, admin_token="secret")


def _embed(url: str, texts, **body) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=60) as client:  # a new connection: any front-end may take it
        return client.post("/infer", json={"inputs": texts, **body})


def _infos(url: str, count: int, tries: int = 200) -> dict[int, dict]:
    """/info from `count` different front-ends (new connections until each has answered, at most `tries`)."""
    seen: dict[int, dict] = {}
    for _ in range(tries):
        with httpx.Client(base_url=url, timeout=30) as client:
            info = client.get("/info").json()
        seen[info["worker"]["pid"]] = info
        if len(seen) == count:
            return seen
    return seen


def _batched_inputs(url: str) -> float:
    """The inputs every engine has run in its batches so far (one scrape counts every process)."""
    metrics = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("fusedserve_batch_size_sum{"))


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The same settings served by one process: the answers to match."""
    tmp = tmp_path_factory.mktemp("single")
    process, url, log_path = launch(tmp, **SETTINGS)
    wait_ready(process, url, log_path)
    yield url
    # uvicorn re-raises the SIGTERM it shut down on
    assert stop(process, log_path) in (0, -signal.SIGTERM), open(log_path).read()


def test_two_front_ends_answer_as_one_process_does(tmp_path, single):
    with socket.socket() as held:  # bound while launch picks the HTTP port: the two differ
        held.bind(("127.0.0.1", 0))
        grpc_port = held.getsockname()[1]
        process, url, log_path = launch(tmp_path, frontends=2, grpc_port=grpc_port, **SETTINGS)
    try:
        wait_ready(process, url, log_path)
        infos = _infos(url, 2)
        assert len(infos) == 2, "every connection went to one front-end"
        for pid, info in infos.items():
            assert info["worker"]["frontends"] == 2 and len(info["worker"]["engines"]) == 1, info["worker"]
            assert info["worker"]["torch_threads"] is None
            assert not _maps_torch(pid), f"front-end {pid} loaded torch"
        expected = np.asarray(_embed(single, TEXTS[:8]).json()["embeddings"])
        got = _embed(url, TEXTS[:8])
        assert got.status_code == 200, got.text
        assert_same_rows(np.asarray(got.json()["embeddings"]), expected)

        # concurrency exactness: 64 clients at once, each answer equal to its own single request's
        alone = {t: np.asarray(_embed(url, t).json()["embeddings"][0]) for t in TEXTS}
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            answers = list(pool.map(lambda t: _embed(url, t), TEXTS))
        for text, r in zip(TEXTS, answers):
            assert r.status_code == 200, r.text
            assert_same_rows(np.asarray(r.json()["embeddings"][0]), alone[text])

        with httpx.Client(base_url=url, timeout=60) as client:
            # the OpenAI route in base64, and int8 / uint8 quantized with the calibration the engine computed at its
            # warm-up (its description carries it: no front-end runs the calibration texts through the engine)
            r = client.post("/v1/embeddings", json={"input": TEXTS[:3], "encoding_format": "base64"})
            assert r.status_code == 200, r.text
            first = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), "<f4")
            assert_same_rows(first, expected[0])
            batched = _batched_inputs(url)
            quantized = [("int8", {}), ("uint8", {"dimensions": 16}), ("int8", {})]
            for encoding, extra in quantized:  # new connections: both front-ends answer some
                body = {"input": TEXTS[:3], "encoding_format": encoding, **extra}
                answers = [httpx.post(u + "/v1/embeddings", json=body, timeout=60) for u in (url, single)]
                assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
                assert answers[0].json()["data"] == answers[1].json()["data"], encoding
            # the engine ran the requests' own inputs and nothing else
            assert _batched_inputs(url) - batched == 3 * len(quantized)
            tokens = client.post("/embed_all", json={"inputs": TEXTS[0]})
            assert tokens.status_code == 200, tokens.text
            reference = httpx.post(single + "/embed_all", json={"inputs": TEXTS[0]}, timeout=60).json()
            assert_same_rows(np.asarray(tokens.json()[0]), np.asarray(reference[0]))
            ids = client.post("/tokenize", json={"inputs": TEXTS[0]}).json()
            assert ids == httpx.post(single + "/tokenize", json={"inputs": TEXTS[0]}, timeout=60).json()
            # KServe v2 over gRPC, served by the front-ends too (each binds the port with SO_REUSEPORT)
            tensor = grpcclient.InferInput("text", [2], "BYTES")
            tensor.set_data_from_numpy(np.array([t.encode() for t in TEXTS[:2]], dtype=np.object_))
            rpc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
            assert_same_rows(rpc.infer(next(iter(infos.values()))["model"], [tensor]).as_numpy("embedding"), expected[:2])
            rpc.close()
            # bad input is the front-end's 4xx, as in one process
            assert client.post("/infer", json={"inputs": []}).status_code == 400
            assert client.post("/infer", json={"inputs": "x", "model": "nope"}).status_code == 404

        # one scrape counts the engine's batches and every front-end's requests
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert "fusedserve_batch_size_count" in metrics
        served = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                     if line.startswith("fusedserve_requests_total{") and 'route="/infer",status="200"' in line)
        assert served >= 1 + len(TEXTS) * 2, metrics

        # the admin switch: applied by the engine, reported by every front-end
        for enabled in (False, True):
            r = httpx.post(url + "/admin/fused", json={"enabled": enabled},
                           headers={"Authorization": "Bearer secret"}, timeout=60)
            assert r.status_code == 200 and r.json()["fused"] is enabled, r.text
            deadline = time.monotonic() + 10
            while {i["fused"] for i in _infos(url, 2).values()} != {enabled}:
                assert time.monotonic() < deadline, "a front-end still reports the old path"
                time.sleep(0.05)
        assert_same_rows(np.asarray(_embed(url, TEXTS[:8]).json()["embeddings"]), expected)
    finally:
        assert stop(process, log_path) == 0, open(log_path).read()


def test_an_engine_or_a_front_end_killed_under_load(tmp_path):
    process, url, log_path = launch(tmp_path, frontends=2, **SETTINGS)
    try:
        wait_ready(process, url, log_path)
        alone = {t: np.asarray(_embed(url, t).json()["embeddings"][0]) for t in TEXTS[:16]}
        engine = _engine_pid(process.pid)
        statuses: list[int] = []
        wrong = 0
        stop_at = [None]

        def client(text: str) -> None:
            nonlocal wrong
            while stop_at[0] is None or time.monotonic() < stop_at[0]:
                try:
                    r = _embed(url, text)
                except httpx.TransportError:
                    statuses.append(-1)
                    continue
                statuses.append(r.status_code)
                if r.status_code == 200:
                    wrong += not np.allclose(np.asarray(r.json()["embeddings"][0]), alone[text], atol=1e-5)
                elif r.status_code == 503:
                    assert "Retry-After" in r.headers, r.text
                    time.sleep(0.05)

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            running = [pool.submit(client, t) for t in TEXTS[:16]]
            time.sleep(1.0)
            killed = time.monotonic()
            os.kill(engine, signal.SIGKILL)
            # readiness false while the engine is away, then true again once its replacement is ready
            saw_unready = False
            deadline = killed + 120
            while True:
                r = httpx.get(url + "/readyz", timeout=5)
                saw_unready |= r.status_code == 503
                if saw_unready and r.status_code == 200:
                    break
                assert time.monotonic() < deadline, open(log_path).read()
                time.sleep(0.05)
            recovered = time.monotonic() - killed
            stop_at[0] = time.monotonic() + 1.0
            for f in running:
                f.result()
        assert wrong == 0
        failed = sum(s != 200 for s in statuses)
        assert set(statuses) <= {200, 503}, sorted(set(statuses))
        assert statuses[-16:].count(200) == 16, "the clients were not served again after the engine came back"
        print(f"engine killed: {failed} of {len(statuses)} requests failed (503), ready again in {recovered:.1f}s")

        # a front-end killed: the other serves meanwhile, and it is started again
        victim = next(iter(_infos(url, 1)))
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        while True:
            try:
                r = _embed(url, TEXTS[0])
                assert r.status_code == 200, r.text
                assert np.allclose(r.json()["embeddings"][0], alone[TEXTS[0]], atol=1e-5)
            except httpx.TransportError:
                pass  # a connection the dead front-end's socket held
            pids = set(_infos(url, 2, tries=20))
            if victim not in pids and len(pids) == 2:
                break
            assert time.monotonic() < killed + 60, open(log_path).read()
        print(f"front-end killed: a new one serves after {time.monotonic() - killed:.1f}s")

        # the parent killed outright: the engine and the front-ends stop by themselves, none left holding the port
        children = _children(process.pid)
        assert len(children) >= 3, children  # the engine and two front-ends
        process.kill()
        process.wait()
        deadline = time.monotonic() + 60
        while alive := [pid for pid in children if Path(f"/proc/{pid}").exists()
                        and Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"]:
            assert time.monotonic() < deadline, f"still running after the parent was killed: {alive}"
            time.sleep(0.1)
    finally:
        if process.poll() is None:
            assert stop(process, log_path) == 0, open(log_path).read()


def _engine_pid(parent: int) -> int:
    """The engine process under the server's parent (its command line names server.engine)."""
    for task in Path(f"/proc/{parent}/task").iterdir():
        for kid in (task / "children").read_text().split():
            if b"fusedserve.server.engine" in Path(f"/proc/{kid}/cmdline").read_bytes():
                return int(kid)
    raise AssertionError("no engine process under the server")
