"""Device lists and workers that fail: where DEVICE and WORKERS place the workers (fake GPU counts, CPUs and free
memory), and on a real `fusedserve serve` with fake GPUs on the CPU (tests.support.server): a GPU whose workers fail
their start is left out with a log line naming it while the rest serve, /info and the metrics carry the device, and
a killed worker comes back, on the kernel path the admin switch set, while the others keep answering, the server
ready throughout."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from fusedserve.server import devices
from fusedserve.server.config import Settings
from fusedserve.server.devices import Placement
from tests.server.conftest import free_port
from tests.server.test_behaviour import _value
from tests.server.test_startup import wait_ready


@pytest.fixture
def gpus(monkeypatch):
    """Fake the visible GPUs, the CPUs and each GPU's free memory."""
    def fake(count: int, cpus: int = 16, free_gib: float | None = 80.0) -> None:
        monkeypatch.setattr(devices, "visible_gpus", lambda: [f"cuda:{i}" for i in range(count)])
        monkeypatch.setattr(devices, "usable_cpus", lambda: cpus)
        monkeypatch.setattr(devices, "free_bytes", lambda name: None if free_gib is None else int(free_gib * 1024**3))
    return fake


def _names(placements: list[Placement]) -> list[str]:
    assert all(p.runs_on == p.name for p in placements)
    return [p.name for p in placements]


def test_explicit_and_default_settings_place_the_workers_as_documented(gpus):
    gpus(2)
    assert _names(devices.place("cpu", 1)) == ["cpu"]
    assert _names(devices.place("cuda:1", 1)) == ["cuda:1"]  # one GPU keeps meaning that one
    assert _names(devices.place("cuda:1", 3)) == ["cuda:1"] * 3
    assert _names(devices.place("cuda", 1)) == ["cuda:0", "cuda:1"]  # every visible GPU
    assert _names(devices.place("auto", 2)) == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]  # WORKERS per device
    assert _names(devices.place("cuda:1,cuda:0", 1)) == ["cuda:1", "cuda:0"]
    gpus(0)
    assert _names(devices.place("auto", 1)) == ["cpu"]
    assert _names(devices.place("auto", "auto")) == ["cpu"]  # one process uses every core
    with pytest.raises(ValueError, match="every visible GPU"):
        devices.place("cuda", 1)
    with pytest.raises(ValueError, match="twice"):
        devices.place("cuda:0,cuda:0", 1)


def test_workers_auto_fits_the_cpus_and_the_free_memory(gpus):
    gpus(1, cpus=16)
    assert len(devices.place("auto", "auto")) == 4  # at most 4 a GPU
    gpus(2, cpus=16)
    assert _names(devices.place("cuda", "auto")) == ["cuda:0"] * 4 + ["cuda:1"] * 4
    gpus(2, cpus=8)
    assert len(devices.place("cuda", "auto")) == 4  # 2 CPUs a worker: 2 a GPU
    gpus(1, cpus=2)
    assert len(devices.place("cuda", "auto")) == 1
    # a large model: 2.5 GiB free holds one worker of a 0.4 GiB model (2 GiB besides its weights), not two
    gpus(1, cpus=64, free_gib=2.5)
    assert len(devices.place("cuda", "auto", model_bytes=400 * 1024**2)) == 1
    gpus(1, cpus=64, free_gib=5.0)
    assert len(devices.place("cuda", "auto", model_bytes=400 * 1024**2)) == 2
    gpus(1, cpus=64, free_gib=None)  # free memory unknown: the CPUs and the cap decide
    assert len(devices.place("cuda", "auto")) == 4


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:3", "cuda:0,cuda:1", "cuda:0,cuda:2,cuda:1"])
def test_device_settings_taken(device, monkeypatch):
    monkeypatch.setenv("FUSEDSERVE_DEVICE", device)
    assert Settings().device == device


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:0,cpu", "cuda:0,", "cpu,cpu", "cuda:0;cuda:1"])
def test_device_settings_refused(device, monkeypatch):
    monkeypatch.setenv("FUSEDSERVE_DEVICE", device)
    with pytest.raises(ValidationError, match="device"):
        Settings()


@pytest.mark.parametrize("workers, ok", [("auto", True), ("3", True), ("0", False), ("-1", False), ("many", False)])
def test_workers_settings(workers, ok, monkeypatch):
    monkeypatch.setenv("FUSEDSERVE_WORKERS", workers)
    if ok:
        assert Settings().workers == (workers if workers == "auto" else int(workers))
    else:
        with pytest.raises(ValidationError, match="workers"):
            Settings()


def _serve(tmp_path, env: dict[str, str]) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("FUSEDSERVE_") and k != "TRITON_INTERPRET"}
    base.update({"PYTHONUNBUFFERED": "1", "FUSEDSERVE_MODEL": "tiny", "FUSEDSERVE_BACKEND": "torch",
                 "FUSEDSERVE_TORCH_THREADS": "1", "FUSEDSERVE_MAX_BATCH_TOKENS": "512", **env})
    log_path = str(tmp_path / f"server-{port}.log")
    process = subprocess.Popen([sys.executable, "-m", "tests.support.server", "--port", str(port),
                                "--log-level", "warning"], stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                               env=base)
    return process, f"http://127.0.0.1:{port}", log_path


def _stop(process) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0


def _info(url: str) -> dict:
    with httpx.Client(base_url=url, timeout=30) as client:  # a new connection: any worker may answer
        return client.get("/info").json()


def test_a_gpu_that_fails_its_start_is_left_out_and_the_rest_serve(tmp_path):
    process, url, log_path = _serve(tmp_path, {"TEST_FAKE_GPUS": "cuda:0,cuda:1", "TEST_BROKEN_GPUS": "cuda:1",
                                               "FUSEDSERVE_DEVICE": "cuda", "FUSEDSERVE_WORKERS": "2"})
    try:
        wait_ready(process, url, log_path)
        log = open(log_path).read()
        assert re.search(r"device cuda:1 left out: worker [23] failed to start \(exit code 1", log), log
        seen = set()
        for i in range(12):
            with httpx.Client(base_url=url, timeout=30) as client:
                assert client.post("/infer", json={"inputs": [f"text {i}"]}).status_code == 200
                info = client.get("/info").json()
                seen.add((info["worker"]["pid"], info["worker"]["device"]))
        assert {device for _, device in seen} == {"cuda:0"} and len(seen) == 2, seen  # both of cuda:0's workers
        text = httpx.get(url + "/metrics", timeout=30).text
        assert _value(text, "fusedserve_device_workers", device="cuda:0") == 2
        assert 'fusedserve_device_workers{device="cuda:1"}' not in text  # its workers are gone: none live there
        assert _value(text, "fusedserve_device_busy_seconds_total", device="cuda:1") == 0  # and never ran a batch
        assert _value(text, "fusedserve_device_busy_seconds_total", device="cuda:0") > 0
    finally:
        _stop(process)


def test_no_device_left_stops_the_server_with_the_failure(tmp_path):
    process, url, log_path = _serve(tmp_path, {"TEST_FAKE_GPUS": "cuda:0,cuda:1", "TEST_BROKEN_GPUS": "cuda:0,cuda:1",
                                               "FUSEDSERVE_DEVICE": "cuda"})
    assert process.wait(timeout=240) == 1, open(log_path).read()
    log = open(log_path).read()
    assert "device cuda:0 left out" in log and "device cuda:1 left out" in log and "no device left" in log, log


def _gone(pid: int, timeout_s: float = 30) -> None:
    """Wait until `pid` has exited (gone, or a zombie its parent has not reaped yet: its files are closed)."""
    deadline = time.monotonic() + timeout_s
    status = Path(f"/proc/{pid}/status")
    while time.monotonic() < deadline:
        try:
            if "\nState:\tZ" in status.read_text():
                return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} still running {timeout_s} s after SIGKILL")


def _listeners(port: int) -> list[str]:
    """The IPv4 TCP sockets listening on `port` (/proc/net/tcp: local address in hex, state 0A)."""
    return [line for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
            if line.split()[1].endswith(f":{port:04X}") and line.split()[3] == "0A"]


def test_a_killed_worker_comes_back_while_the_others_keep_answering(tmp_path):
    process, url, log_path = _serve(tmp_path, {"FUSEDSERVE_WORKERS": "2", "FUSEDSERVE_DEVICE": "cpu",
                                               "FUSEDSERVE_ADMIN_TOKEN": "secret"})
    try:
        wait_ready(process, url, log_path)
        # the workers were switched to the reference path: the one that comes back must be too
        r = httpx.post(url + "/admin/fused", json={"enabled": False}, headers={"Authorization": "Bearer secret"},
                       timeout=60)
        assert r.status_code == 200 and r.json()["workers"] == {"switched": 2, "of": 2}, r.text
        pids = set()
        deadline = time.monotonic() + 60
        while len(pids) < 2 and time.monotonic() < deadline:
            pids.add(_info(url)["worker"]["pid"])
        assert len(pids) == 2
        victim = min(pids)
        os.kill(victim, signal.SIGKILL)
        _gone(victim)
        # the kernel drops a killed process's listening socket a moment after the process is gone (no process holds
        # it by then): a connection hashed to it meanwhile is reset. Counted from when it has left.
        port = int(url.rsplit(":", 1)[1])
        deadline = time.monotonic() + 10
        while len(_listeners(port)) > 1:
            assert time.monotonic() < deadline, _listeners(port)
            time.sleep(0.005)
        answered, failed, back = 0, [], None
        deadline = time.monotonic() + 60
        while back is None and time.monotonic() < deadline:
            with httpx.Client(base_url=url, timeout=30) as client:
                try:
                    r = client.post("/infer", json={"inputs": ["still answered"]})
                    ok = r.status_code == 200
                    if not ok:
                        failed.append(f"{r.status_code} {r.text}")
                    assert client.get("/readyz").status_code == 200  # the server stays ready: the others serve
                    pid = client.get("/info").json()["worker"]["pid"]
                except httpx.TransportError as exc:
                    ok, pid = False, None
                    failed.append(f"{type(exc).__name__}: {exc} at {time.monotonic() - (deadline - 60):.2f} s")
            answered += ok
            if pid is not None and pid not in pids:
                back = time.monotonic() - (deadline - 60)
        assert back is not None and back < 30, open(log_path).read()
        seen = {}
        while len(seen) < 2:
            info = _info(url)
            seen[info["worker"]["pid"]] = info["fused"]
        assert set(seen.values()) == {False}, seen  # the new worker took the switch before its first request
        # the killed worker held no request: none may fail (its socket died with it, so none lands there)
        assert not failed and answered > 0, (answered, failed, open(log_path).read())
        log = open(log_path).read()
        assert f"(pid {victim}) exited with -9; starting it again" in log and "is ready again" in log, log
    finally:
        _stop(process)
