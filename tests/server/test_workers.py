"""WORKERS=2 on a real `fusedserve serve`: two processes on one port, each with its own model; /readyz turns 200 only
once both are ready; connections land on both; any worker's /metrics counts every worker's requests (multiprocess
mode); answers equal a single server's; the admin switch reaches both; SIGTERM stops the parent and both workers
cleanly."""

from __future__ import annotations

import json
import socket
import time

import httpx
import numpy as np
import pytest

from tests.server.test_startup import launch, stop, wait_ready
from tests.tolerances import assert_same_rows

TEXTS = [f"sentence number {i} about workers sharing one port" for i in range(24)]


def test_two_workers_share_the_port_the_readiness_and_the_metrics(tmp_path):
    process, url, log_path = launch(tmp_path, workers=2, model="tiny", backend="torch", torch_threads=1,
                                    max_batch_tokens=512, admin_token="secret")
    try:
        deadline = time.monotonic() + 240
        while True:
            assert process.poll() is None, open(log_path).read()
            try:
                r = httpx.get(url + "/readyz", timeout=2)
                if r.status_code == 200:
                    break
                assert r.json()["status"] == "loading", r.text
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, open(log_path).read()
            time.sleep(0.1)
        pids, vectors = set(), {}
        for text in TEXTS:  # a new connection each: the kernel spreads them over the workers
            with httpx.Client(base_url=url, timeout=30) as client:
                vectors[text] = np.asarray(client.post("/infer", json={"inputs": text}).json()["embeddings"][0])
                info = client.get("/info").json()
                assert info["worker"]["workers"] == 2 and info["ready"]
                # TORCH_THREADS=1: one intra-op thread, and the tokenizer's pool as narrow
                assert info["worker"]["torch_threads"] == info["worker"]["tokenizer_threads"] == 1, info["worker"]
                pids.add(info["worker"]["pid"])
        assert len(pids) == 2, "every connection went to one worker"
        # on the CPU nothing is compiled or raced, so no worker waits for the first to fill the kernel cache
        assert "waiting for the first worker" not in open(log_path).read()
        # the same text gets the same vector from either worker: the same request to the same weights (the preset's
        # fixed seed) on the same kernels
        for _ in range(4):
            with httpx.Client(base_url=url, timeout=30) as client:
                again = np.asarray(client.post("/infer", json={"inputs": TEXTS[0]}).json()["embeddings"][0])
            assert_same_rows(again, vectors[TEXTS[0]])
        # both workers' counts, from whichever answers the scrape; a request is counted as its response ends, which
        # the client may see first: poll until every answer is counted (more would fail at once)
        expected = len(TEXTS) + 4
        deadline = time.monotonic() + 30
        while (answered := _answered(metrics := httpx.get(url + "/metrics", timeout=30).text)) < expected:
            assert time.monotonic() < deadline, f"{answered} of {expected} answers counted:\n{metrics}"
            time.sleep(0.05)
        assert answered == expected, metrics
        assert f'fusedserve_model_ready{{model="{info["model"]}"}} 1.0' in metrics
        # the fused switch reaches both workers, whichever one the request lands on, and answers once both switched
        for enabled in (False, True):
            r = httpx.post(url + "/admin/fused", json={"enabled": enabled}, headers={"Authorization": "Bearer secret"},
                           timeout=60)
            assert r.status_code == 200 and r.json()["workers"] == {"switched": 2, "of": 2}, r.text
            seen = {}
            while len(seen) < 2:  # new connections until both workers have answered
                with httpx.Client(base_url=url, timeout=30) as client:
                    info = client.get("/info").json()
                seen[info["worker"]["pid"]] = info["fused"]
            assert set(seen.values()) == {enabled}, seen
    finally:
        assert stop(process, log_path) == 0, open(log_path).read()


def _answered(metrics: str) -> float:
    """The /infer requests answered 200, summed over every series (the workers' files are summed already)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("fusedserve_requests_total{") and 'route="/infer"' in line and 'status="200"' in line)


def test_workers_share_out_the_cores_unless_torch_threads_is_set(monkeypatch, tmp_path):
    """Without TORCH_THREADS each of N workers takes cores / N intra-op threads (at least one), the cores being the
    affinity capped by a cgroup CPU quota; one worker, or an operator's OMP_NUM_THREADS, keeps torch's default (0)."""
    from fusedserve.server import devices, workers

    monkeypatch.setattr(devices.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    quota = tmp_path / "cpu.max"
    real_path = devices.Path
    monkeypatch.setattr(devices, "Path", lambda p: quota if p == "/sys/fs/cgroup/cpu.max" else real_path(p))
    quota.write_text("max 100000\n")
    assert [workers.threads_per_worker(n) for n in (1, 2, 3, 4, 16, 32)] == [0, 8, 5, 4, 1, 1]
    quota.write_text("400000 100000\n")  # a pod limited to four CPUs on a 16-core node
    assert [workers.threads_per_worker(n) for n in (2, 4, 8)] == [2, 1, 1]
    quota.unlink()  # no cgroup v2 file: the affinity alone
    assert workers.threads_per_worker(2) == 8
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert workers.threads_per_worker(4) == 0


def _info_pid(sock: socket.socket) -> int:
    """GET /info on an open keep-alive connection: the answering worker's pid."""
    sock.sendall(b"GET /info HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return json.loads(body)["worker"]["pid"]


@pytest.mark.slow  # four server processes, each loading its model
def test_keep_alive_connections_spread_over_four_workers(tmp_path):
    """One listening socket per worker (SO_REUSEPORT): the kernel spreads new connections over the workers. With one
    shared socket a worker that wakes takes every connection waiting (asyncio accepts the whole backlog at once),
    and a keep-alive client stays where it lands (docs/decisions/0027-a-listening-socket-per-worker.md). The 64
    connections here are opened at once, before any is used. The kernel picks a socket by a hash of the connection,
    so the bounds leave room for chance (every worker holds at least 4 of 64 and none more than half: chance breaks
    that about once in 10,000 runs); a shared socket's burst fails them."""
    process, url, log_path = launch(tmp_path, workers=4, model="tiny", backend="torch", torch_threads=1,
                                    warmup=False, max_batch_tokens=256)
    host, port = url.removeprefix("http://").split(":")
    sockets: list[socket.socket] = []
    try:
        wait_ready(process, url, log_path)
        sockets = [socket.create_connection((host, int(port)), timeout=30) for _ in range(64)]
        held: dict[int, int] = {}
        for sock in sockets:
            pid = _info_pid(sock)
            held[pid] = held.get(pid, 0) + 1
        for sock in sockets:  # each stays where it landed
            assert _info_pid(sock) in held
        counts = sorted(held.values())
        assert len(counts) == 4 and counts[0] >= 4 and counts[-1] <= 32, held
    finally:
        for sock in sockets:
            sock.close()
        assert stop(process, log_path) == 0, open(log_path).read()
