"""Real servers for the HTTP tests: `fusedserve serve` under uvicorn on 127.0.0.1, a free port each,
configured through FUSEDSERVE_* environment variables, stopped with SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import numpy as np
import pytest

from bench.harness import free_port  # noqa: F401  (also imported by other test modules)

ADMIN_TOKEN = "test-admin-token"


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log_path: str

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)


def start_server(tmp_path, ready_timeout_s: float = 180, *, faults: bool = False, preexec_fn=None,
                 **settings) -> Server:
    """faults=True: the test-only app with fault hooks under /admin/faults (tests.support.server). preexec_fn: run in
    the server's process before it starts (e.g. to lower its resource limits)."""
    port = free_port()
    # the server's settings come only from here; the CUDA extension's build cache is not a setting and is kept
    env = {k: v for k, v in os.environ.items()
           if (not k.startswith("FUSEDSERVE_") or k == "FUSEDSERVE_CUDA_CACHE") and k != "TRITON_INTERPRET"}
    env.update({
        "FUSEDSERVE_MAX_BATCH_TOKENS": "2048",  # keeps the CPU warm-up short
        "FUSEDSERVE_ADMIN_TOKEN": ADMIN_TOKEN,
        "PYTHONUNBUFFERED": "1",
    })
    env.update({f"FUSEDSERVE_{k.upper()}": str(v) for k, v in settings.items()})
    log_path = str(tmp_path / f"server-{port}.log")
    log = open(log_path, "w")
    command = ["-m", "tests.support.server"] if faults else ["-m", "fusedserve", "serve"]
    # info: the start-up report is an info line
    process = subprocess.Popen([sys.executable, *command, "--port", str(port), "--log-level", "info"],
                               stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=preexec_fn)
    server = Server(f"http://127.0.0.1:{port}", process, log_path)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.url + "/readyz", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"server not ready in time:\n{server.log()}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The default service (packaged MiniLM on the CPU), shared by a test module."""
    srv = start_server(tmp_path_factory.mktemp("server"))
    yield srv
    srv.stop()


@pytest.fixture
def make_server(tmp_path):
    """Start servers with custom settings inside one test; all are stopped afterwards."""
    started: list[Server] = []

    def make(**settings) -> Server:
        srv = start_server(tmp_path, **settings)
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


def admin_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def padded_ids(url: str, texts: list[str], dtype=np.int64) -> tuple[np.ndarray, np.ndarray]:
    """The texts' token ids as the server at `url` tokenizes them (/tokenize), right-padded with 0, and their mask:
    the KServe clients' token-id inputs."""
    rows = [[t["id"] for t in row] for row in
            httpx.post(url + "/tokenize", json={"inputs": texts}, timeout=60).json()]
    width = max(map(len, rows))
    ids, mask = np.zeros((len(rows), width), dtype), np.zeros((len(rows), width), dtype)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = row, 1
    return ids, mask
