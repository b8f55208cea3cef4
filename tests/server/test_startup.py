"""Start-up as an orchestrator sees it, on real `fusedserve serve` processes: the port answers while the model
loads (/healthz 200, /readyz 503 saying what is loading, inference 503 with Retry-After), then /readyz turns 200;
a SIGTERM during the load stops the process; a model that fails to load stops it with a non-zero exit and the error
in the log."""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.server.conftest import free_port


def launch(tmp_path, **settings) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if (not k.startswith("FUSEDSERVE_") or k == "FUSEDSERVE_CUDA_CACHE") and k != "TRITON_INTERPRET"}
    env.update({"PYTHONUNBUFFERED": "1", **{f"FUSEDSERVE_{k.upper()}": str(v) for k, v in settings.items()}})
    log_path = str(tmp_path / f"server-{port}.log")
    process = subprocess.Popen([sys.executable, "-m", "fusedserve", "serve", "--port", str(port), "--log-level", "warning"],
                               stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)
    return process, f"http://127.0.0.1:{port}", log_path


def wait_ready(process: subprocess.Popen, url: str, log_path: str, timeout_s: float = 240) -> None:
    """Until /readyz answers 200; the server's log is the failure if it exits or the time runs out first."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, open(log_path).read()
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, open(log_path).read()
        time.sleep(0.1)


def _children(pid: int) -> list[int]:
    """The process's children and theirs (a WORKERS > 1 parent's workers sit in process groups of their own)."""
    found = []
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            kids = [int(k) for k in Path(task).read_text().split()]
        except OSError:
            continue
        for kid in kids:
            found += [kid, *_children(kid)]
    return found


def stop(process: subprocess.Popen, log_path: str, timeout_s: float = 60) -> int:
    """SIGTERM the server and wait for its exit code. A server that outlives the timeout is killed with every process
    under it (none left holding the port or the CPUs for the tests after), and the test fails with its log."""
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        left = _children(process.pid)
        for pid in [process.pid, *left]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait()
        raise AssertionError(f"the server and {len(left)} processes under it were still running {timeout_s:.0f} s "
                             f"after SIGTERM:\n{open(log_path).read()}") from None


def first_answer(process, url: str, timeout_s: float = 120) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, "the server exited"
        try:
            return httpx.get(url + "/readyz", timeout=2)
        except httpx.TransportError:
            time.sleep(0.02)
    raise AssertionError("the port never answered")


def test_readyz_says_what_is_loading_then_ready(tmp_path):
    # a larger warm-up batch than the other tests' keeps the load long enough to watch on any machine
    process, url, log_path = launch(tmp_path, max_batch_tokens=8192)
    try:
        first = first_answer(process, url)
        assert first.status_code == 503, first.text
        body = first.json()
        assert body["status"] == "loading" and body["phase"] in ("starting", "loading", "warmup", "calibration")
        assert body["error"]["type"] == "unavailable"
        assert httpx.get(url + "/healthz").status_code == 200  # live while loading
        r = httpx.post(url + "/infer", json={"inputs": "too early"}, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] and "loading" in r.json()["error"]["message"]
        assert httpx.get(url + "/v2/health/ready").status_code == 503
        phases = [body["phase"]]
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            r = httpx.get(url + "/readyz", timeout=2)
            if r.status_code == 200:
                break
            assert r.status_code == 503 and r.json()["status"] == "loading", r.text
            progress = r.json()["progress"]
            assert progress is None or 0 <= progress <= 1
            if r.json()["phase"] != phases[-1]:
                phases.append(r.json()["phase"])
            time.sleep(0.05)
        assert r.status_code == 200 and r.json() == {"status": "ready"}, (phases, open(log_path).read())
        order = ["starting", "loading", "warmup", "cuda_graphs", "calibration", "loaded"]
        assert phases == sorted(phases, key=order.index), phases  # phases only move forward
        assert httpx.post(url + "/infer", json={"inputs": "now"}, timeout=60).status_code == 200
    finally:
        assert stop(process, log_path) in (0, -signal.SIGTERM), open(log_path).read()  # uvicorn re-raises it


def test_sigterm_during_the_load_stops_the_process(tmp_path):
    process, url, log_path = launch(tmp_path, max_batch_tokens=8192)
    try:
        assert first_answer(process, url).status_code == 503
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) in (0, -signal.SIGTERM), open(log_path).read()  # uvicorn re-raises it
    finally:
        if process.poll() is None:
            process.kill()


def test_a_model_that_fails_to_load_stops_the_process(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    process, url, log_path = launch(tmp_path, model=str(missing))
    try:
        code = process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    log = open(log_path).read()
    assert code == 1, log
    assert "start-up failed" in log and str(missing) in log
    assert "Traceback" in log  # the cause, once, with its traceback
