"""Several server processes on one port: WORKERS per device, on each device of DEVICE (server.devices), each with
its own listening socket and its own models on its one device.

One Python process is host-bound long before an H200 is busy (its event loop parses, tokenizes and answers every
request), so the throughput of one GPU comes from several processes feeding it, and a node's GPUs from processes
placed on each. The parent binds one socket per worker on the port (SO_REUSEPORT) and spawns the workers (spawn, not
fork: CUDA must not be initialized in a forked child); the kernel spreads new connections over the sockets by a hash
of each. With one shared socket a worker that wakes accepts every connection waiting (asyncio takes the whole
backlog at once), and keep-alive clients stay where they land: one worker would hold most of the clients and cap
the throughput of all (docs/decisions/0027-a-listening-socket-per-worker.md). With the CUDA MPS daemon running
(docs/operations.md) the kernels of one GPU's workers share it concurrently instead of time-slicing.

- Start: on a GPU the first worker loads alone and fills the kernel cache (compiles, autotuning, races); the others
  load once it is ready, from the cache. On the CPU, where nothing is compiled or raced, they all load at once. The
  parent closes its copy of each socket once the worker holding it runs, so a worker's socket dies with it.
- Readiness: a worker answers /readyz 200 only once every worker the server counts is ready (each marks itself in
  the shared state directory; the parent keeps the count in `expected`), so a probe never sees a pod ready whose
  next connection lands on a worker still loading.
- Metrics: prometheus-client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR, one directory per start): any worker's
  /metrics answers for all of them, counters and histograms summed, gauges as each declares (server.metrics). The
  alternative, a `worker` label per process, would leave each scrape with one worker's numbers.
- Failure (docs/decisions/0022-workers-that-fail.md): a worker that exits after it was ready is started again while
  the others keep serving. Its socket closed with it, so new connections go to the others; the new worker binds a
  socket that listens only once its models are ready, and the server stays ready meanwhile (it no longer counts that
  worker). A worker that fails before it was ready, at the start or three times in a row after one, takes its device
  out: that device's other workers stop, with a log line naming the device and the exit code, and the server serves
  from the rest. With no device left the parent exits with the failure's code (1 for a model that failed to load).
- Signals: SIGTERM or SIGINT on the parent sends SIGTERM to every worker (each in its own process group, so it gets
  one signal, not the terminal's too), and each drains as a single server does.
- The admin fused switch reaches every worker: the worker a request lands on writes it to the state directory,
  every worker applies it within a fraction of a second, and the answer comes once all of them have.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock
from prometheus_client import multiprocess

from fusedserve.server.devices import Placement, runs_on, usable_cpus

log = logging.getLogger("fusedserve")

STATE_ENV = "FUSEDSERVE_WORKERS_STATE"  # the shared state directory, set by the parent for its workers
INDEX_ENV = "FUSEDSERVE_WORKER_INDEX"  # this worker's number, 0 for the first
DEVICE_ENV = "FUSEDSERVE_WORKER_DEVICE"  # the device this worker was placed on, as /info and the metrics name it
REJOIN_ENV = "FUSEDSERVE_WORKER_REJOIN"  # set for a worker started again: it listens only once ready
ENGINES_ENV = "FUSEDSERVE_ENGINES"  # FRONTENDS: the engines' addresses, comma-separated, set for the front-ends

FAILED_STARTS = 3  # a restarted worker failing this many starts in a row takes its device out
RESTART_DELAY_S = (0.5, 2.0, 5.0)  # before the first, second and later restarts in a row


def state_dir() -> Path | None:
    """The workers' shared directory, or None in a single-process server."""
    value = os.environ.get(STATE_ENV)
    return Path(value) if value else None


def device_name(default: str | None) -> str | None:
    """The device this process serves on, by the name the operator gave (`default`: a single server's setting)."""
    return os.environ.get(DEVICE_ENV, default)


def rejoining() -> bool:
    """This worker replaces one that exited: it must not take connections until its models are ready."""
    return os.environ.get(REJOIN_ENV) == "1"


def mark_ready() -> None:
    """This worker is ready (no-op in a single-process server)."""
    directory = state_dir()
    if directory is not None:
        (directory / f"ready-{os.getpid()}").touch()


def wait_for_the_first() -> None:
    """Workers after the first wait until it is ready before they load: the first compiles, tunes and races the
    kernels into the cache directory, and the others then take all of it from there in seconds, instead of every
    worker autotuning and timing races on one GPU beside the others' start-up work (noisy races could make workers
    choose different backends). No-op in a single-process server, in the first worker, and in a restarted one."""
    directory = state_dir()
    if directory is None or os.environ.get(INDEX_ENV, "0") == "0" or rejoining():
        return
    log.warning("worker %s: waiting for the first worker to be ready (it fills the kernel cache)",
                os.environ[INDEX_ENV])
    while not any(directory.glob("ready-*")) and not (directory / "first-failed").exists():
        time.sleep(0.2)


def all_ready() -> bool:
    """Every worker the server counts is ready (True in a single-process server: the caller checks its own state)."""
    directory = state_dir()
    if directory is None:
        return True
    try:
        expected = int((directory / "expected").read_text())
    except (OSError, ValueError):  # being rewritten: the count the server started with
        expected = int(os.environ.get("FUSEDSERVE_WORKERS", "1"))
    return len(list(directory.glob("ready-*"))) >= expected


# ---- the admin fused switch, for every worker ------------------------------------------------------------------
# The worker a request reaches writes the switch to `switch.json` (a generation number, the model or every model, on
# or off) and applies it; every worker's watcher applies each new generation within SWITCH_POLL_S and acknowledges
# it in `switched-<pid>`; the request answers once every worker counted ready has (a worker started again applies
# the latest switch before it is ready).
SWITCH_POLL_S = 0.1


def publish_switch(enabled: bool, model: str | None) -> dict:
    """Write the switch for every worker; returns it, with its generation."""
    directory = state_dir()
    with FileLock(str(directory / "switch.lock")):
        switch = {"generation": (read_switch() or {}).get("generation", 0) + 1, "enabled": enabled, "model": model}
        tmp = directory / f"switch.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(switch))
        tmp.replace(directory / "switch.json")
    return switch


def read_switch() -> dict | None:
    directory = state_dir()
    try:
        return json.loads((directory / "switch.json").read_text())
    except (OSError, ValueError):
        return None


def acknowledge_switch(generation: int) -> None:
    tmp = state_dir() / f"switched-{os.getpid()}.tmp"
    tmp.write_text(str(generation))
    tmp.replace(state_dir() / f"switched-{os.getpid()}")


def switched_workers(generation: int) -> tuple[int, int]:
    """(ready workers that applied `generation` or a later one, ready workers)."""
    directory = state_dir()
    pids = [p.name.removeprefix("ready-") for p in directory.glob("ready-*")]
    done = 0
    for pid in pids:
        try:
            done += int((directory / f"switched-{pid}").read_text()) >= generation
        except (OSError, ValueError):
            pass
    return done, len(pids)


def bind(host: str, port: int, *, reuse_port: bool = False, listen: bool = True) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    if listen:  # a socket that does not listen yet takes no connections; its server listens on it when it starts
        sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def bind_each(host: str, port: int, count: int) -> list[socket.socket]:
    """One listening socket per worker on host:port (port 0: the first one's), SO_REUSEPORT; where the platform has
    no SO_REUSEPORT, one socket shared by all."""
    if not hasattr(socket, "SO_REUSEPORT"):
        return [bind(host, port)] * count
    first = bind(host, port, reuse_port=True)
    return [first, *(bind(host, first.getsockname()[1], reuse_port=True) for _ in range(count - 1))]


@dataclass(kw_only=True)
class Restarts:
    """The restart policy of a process slot, a worker's and an engine's alike: a process that exits after it was
    ready is started again after RESTART_DELAY_S[0]; one that exits before it was ready is a failed start, started
    again only if a process of this slot was ever ready, after RESTART_DELAY_S[n] for the n-th failed start in a row,
    and not after the FAILED_STARTS-th (its owner then takes the device out, or stops the server)."""

    ready: bool = False  # the slot's current process has been seen ready
    ever_ready: bool = False  # some process of this slot has been ready
    failed_starts: int = 0  # in a row, since the last ready process
    restart_at: float | None = None  # monotonic time of a pending restart

    def spawned(self) -> None:
        self.ready = False

    def seen_ready(self) -> None:
        self.ready = self.ever_ready = True
        self.failed_starts = 0

    def exited(self, now: float) -> float | None:
        """The current process exited: the delay before the slot's next start (restart_at set), or None where it
        failed to start and is not started again."""
        was_ready, self.ready = self.ready, False
        if not was_ready:
            self.failed_starts += 1
            if not self.ever_ready or self.failed_starts >= FAILED_STARTS:
                return None
        delay = RESTART_DELAY_S[min(self.failed_starts, len(RESTART_DELAY_S) - 1)]
        self.restart_at = now + delay
        return delay

    def due(self, now: float) -> bool:
        """A pending restart's time has come (it is then no longer pending)."""
        if self.restart_at is None or now < self.restart_at:
            return False
        self.restart_at = None
        return True


@dataclass
class _Slot(Restarts):
    """One worker's place: its device, the process holding it now, and its restarts."""

    index: int
    placement: Placement
    sock: socket.socket | None
    process: multiprocessing.process.BaseProcess | None = None
    counted: bool = True  # `expected` counts this slot (not while a restarted worker loads)
    handed_over: bool = False  # the worker runs: the parent's copy of its socket is closed


class _Supervisor:
    def __init__(self, placements: list[Placement], argv: list[str], host: str, port: int, target) -> None:
        self.argv, self.host, self.target = argv, host, target
        self.state = Path(tempfile.mkdtemp(prefix="fusedserve-workers-"))
        (self.state / "metrics").mkdir()
        os.environ.update({STATE_ENV: str(self.state), "FUSEDSERVE_WORKERS": str(len(placements)),
                           "PROMETHEUS_MULTIPROC_DIR": str(self.state / "metrics")})
        sockets = bind_each(host, port, len(placements))
        self.port = sockets[0].getsockname()[1]
        self.shared_socket = len(set(sockets)) == 1
        self.slots = [_Slot(i, p, sock) for i, (p, sock) in enumerate(zip(placements, sockets))]
        self.context = multiprocessing.get_context("spawn")
        self.left_out: dict[str, int] = {}  # device -> the exit code that took it out
        self.first_failure: int | None = None
        self._write_expected()

    def _write_expected(self) -> None:
        tmp = self.state / "expected.tmp"
        tmp.write_text(str(sum(s.counted for s in self.slots)))
        tmp.replace(self.state / "expected")

    def spawn(self, slot: _Slot, rejoin: bool = False) -> None:
        slot.process = self.context.Process(
            target=self.target, args=(self.argv, slot.sock, slot.index, slot.placement, rejoin),
            name=f"fusedserve-worker-{slot.index}", daemon=False)
        slot.process.start()
        slot.spawned()
        slot.handed_over = False

    def live(self) -> list[_Slot]:
        return [s for s in self.slots if s.process is not None and s.process.is_alive()]

    def stop_all(self) -> None:  # SIGTERM whatever the parent got: each worker drains as a single server does
        for slot in self.slots:
            if slot.process is not None and slot.process.pid is not None and slot.process.is_alive():
                os.kill(slot.process.pid, signal.SIGTERM)

    def watch(self) -> None:
        """One look at every worker: ready ones marked, exited ones started again or their device left out."""
        now = time.monotonic()
        for slot in self.slots:
            p = slot.process
            if p is None:
                if slot.due(now):
                    self._restart(slot)
                continue
            if not slot.handed_over and (self.state / f"started-{p.pid}").exists() and not self.shared_socket:
                slot.sock.close()  # the worker holds its own copy: the socket now dies with the worker
                slot.handed_over = True
            if p.is_alive():
                if not slot.ready and (self.state / f"ready-{p.pid}").exists():
                    slot.seen_ready()
                    if not slot.counted:
                        log.warning("worker %d on %s (pid %d) is ready again", slot.index, slot.placement.name, p.pid)
                        slot.counted = True
                        self._write_expected()
                continue
            self._exited(slot, p)

    def _exited(self, slot: _Slot, p) -> None:
        code, was_ready, device = p.exitcode, slot.ready, slot.placement.name
        multiprocess.mark_process_dead(p.pid, str(self.state / "metrics"))  # its live gauges no longer count
        if not slot.handed_over and not self.shared_socket:
            slot.sock.close()
        slot.process, slot.counted = None, False
        if not self.shared_socket:
            slot.sock = None
        # the count first, then the marker: a probe in between must never see fewer ready workers than expected
        # (the others are ready, and the server with them)
        self._write_expected()
        (self.state / f"ready-{p.pid}").unlink(missing_ok=True)
        if device in self.left_out:  # stopped with its device: not started again
            slot.ready = False
            return
        delay = slot.exited(time.monotonic())
        if delay is None:
            self._leave_out(device, code, slot)
        elif was_ready:
            log.critical("worker %d on %s (pid %d) exited with %s; starting it again, the other workers keep serving",
                         slot.index, device, p.pid, code)
        else:
            log.critical("worker %d on %s (pid %d) failed to start again (exit code %s); trying again in %.1fs",
                         slot.index, device, p.pid, code, delay)

    def _leave_out(self, device: str, code: int | None, slot: _Slot) -> None:
        if device in self.left_out:
            return
        self.left_out[device] = code if code and code > 0 else 1
        if self.first_failure is None:
            self.first_failure = self.left_out[device]
        if slot.index == 0:  # the workers waiting for the first one to fill the kernel cache need not wait
            (self.state / "first-failed").touch()
        others = [s for s in self.slots if s.placement.name == device and s is not slot]
        log.critical("device %s left out: worker %d failed to start (exit code %s; its log lines above say why)%s",
                     device, slot.index, code, f"; stopping its {len(others)} other workers" if others else "")
        for s in [slot, *others]:
            s.restart_at, s.counted = None, False
            if s.process is not None and s.process.is_alive():
                os.kill(s.process.pid, signal.SIGTERM)
        self._write_expected()

    def _restart(self, slot: _Slot) -> None:
        # bound now, listening only once the new worker is ready (REJOIN_ENV): until then the others take its share
        if not self.shared_socket:
            slot.sock = bind(self.host, self.port, reuse_port=True, listen=False)
        self.spawn(slot, rejoin=True)
        log.warning("worker %d on %s started again (pid %d)", slot.index, slot.placement.name, slot.process.pid)

    def serving(self) -> bool:
        """Some device still has a worker running or coming back."""
        return any(s.process is not None or s.restart_at is not None for s in self.slots
                   if s.placement.name not in self.left_out)

    def close(self) -> None:
        for slot in self.slots:
            if slot.sock is not None and not slot.handed_over:
                slot.sock.close()
        shutil.rmtree(self.state, ignore_errors=True)


class EngineProcesses:
    """FRONTENDS: the parent's engines (server.engine), one process per device, each its models on that device,
    listening on a socket in the workers' state directory. An engine that exits after it was ready is started again
    (its front-ends answer 503 meanwhile: server.frontend); one that fails before it was ready, at the start or
    FAILED_STARTS times in a row after an exit, stops the server with its exit code (Restarts, as a worker's)."""

    def __init__(self, names: list[str], log_level: str) -> None:
        self.names, self.log_level = names, log_level
        self.state: Path | None = None
        self.processes: list[subprocess.Popen | None] = [None] * len(names)
        self.restarts = [Restarts() for _ in names]  # each device's engine

    def addresses(self) -> list[str]:
        return [f"ipc://{self.state}/engine-{i}" for i in range(len(self.names))]

    def start(self, state: Path) -> dict[str, str]:
        """Start every engine; returns the environment their front-ends need."""
        self.state = state
        for i in range(len(self.names)):
            self._spawn(i)
        return {ENGINES_ENV: ",".join(self.addresses())}

    def _spawn(self, i: int) -> None:
        name = self.names[i]
        env = {**os.environ, "FUSEDSERVE_DEVICE": runs_on(name), DEVICE_ENV: name}
        self.processes[i] = subprocess.Popen(
            [sys.executable, "-m", "fusedserve.server.engine", "--address", self.addresses()[i],
             "--log-level", self.log_level], env=env, preexec_fn=os.setpgrp)
        self.restarts[i].spawned()
        log.warning("engine %d on %s starting (pid %d)", i, name, self.processes[i].pid)

    def watch(self) -> int | None:
        """One look at every engine: ready ones marked, exited ones started again; the exit code that stops the
        server, if one does."""
        now = time.monotonic()
        for i, (p, restarts) in enumerate(zip(self.processes, self.restarts)):
            if p is None:
                if restarts.due(now):
                    self._spawn(i)
                continue
            if not restarts.ready and (self.state / f"engine-ready-{p.pid}").exists():
                restarts.seen_ready()
            code = p.poll()
            if code is None:
                continue
            multiprocess.mark_process_dead(p.pid, str(self.state / "metrics"))
            self.processes[i] = None
            delay = restarts.exited(now)
            if delay is None:
                log.critical("engine %d on %s failed to start (exit code %s; its log lines above say why); stopping",
                             i, self.names[i], code)
                return code if code and code > 0 else 1
            log.critical("engine %d on %s (pid %d) exited with %s; starting it again in %.1fs (its front-ends answer "
                         "503 meanwhile)", i, self.names[i], p.pid, code, delay)
        return None

    def stop(self) -> None:
        """SIGTERM to every engine (after the front-ends have drained), then wait for each."""
        for p in self.processes:
            if p is not None and p.poll() is None:
                p.terminate()
        for p in self.processes:
            if p is not None:
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def supervise(placements: list[Placement], argv: list[str], host: str, port: int, target,
              engines: EngineProcesses | None = None) -> int:
    """Bind host:port, run `target(argv, sock, index, placement, rejoin)` for each placement in a spawned process,
    and keep them running (the module's docstring says how). With `engines` (FRONTENDS) the processes are front-ends,
    and the engines start first and stop last. Returns 0 when a signal stopped them and each ended cleanly; else the
    first failure's code, once no device is left (or an engine's that failed its start)."""
    sup = _Supervisor(placements, argv, host, port, target)
    signalled = False
    engine_failure = None

    def on_signal(signum, frame) -> None:
        nonlocal signalled
        signalled = True
        sup.stop_all()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if engines is not None:
            os.environ.update(engines.start(sup.state))
        for slot in sup.slots:
            if signalled:
                break
            sup.spawn(slot)
        started = [s for s in sup.slots if s.process is not None]
        devices = sorted({s.placement.name for s in started})
        log.warning("%d %s on http://%s:%d, on %s (pids %s)", len(started), "workers" if engines is None else
                    "front-ends", host, sup.port, ", ".join(devices), " ".join(str(s.process.pid) for s in started))
        while not signalled and sup.serving():
            sup.watch()
            if engines is not None and (engine_failure := engines.watch()) is not None:
                break
            time.sleep(0.1)
        sup.stop_all()
        ended = [s.process for s in sup.slots if s.process is not None]
        for process in ended:
            process.join()
        if engine_failure is not None:
            return engine_failure
        if not signalled:
            log.critical("no device left to serve on (%s); stopping", ", ".join(
                f"{d}: exit code {c}" for d, c in sup.left_out.items()))
            return sup.first_failure or 1
        # after the parent's SIGTERM a worker ends by it (uvicorn re-raises the signal once it has shut down)
        failed = [p.exitcode for p in ended if p.exitcode not in (0, -signal.SIGTERM)]
        return next((code for code in failed if code > 0), 1) if failed else 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if engines is not None:
            engines.stop()
        sup.close()


def run_worker(main, argv: list[str], sock: socket.socket, index: int, placement: Placement, rejoin: bool) -> None:
    """A worker process: `main(argv, sockets=[sock])` (the same start as `fusedserve serve`, on the parent's socket;
    the serve command hands its own main in, so this module never imports it), its models on `placement`. In a
    process group of its own, so a terminal's Ctrl-C or a service manager's group-wide signal reaches it once,
    through the parent."""
    os.setpgrp()
    os.environ.update({INDEX_ENV: str(index), DEVICE_ENV: placement.name, "FUSEDSERVE_DEVICE": placement.runs_on})
    if rejoin:
        os.environ[REJOIN_ENV] = "1"
    (state_dir() / f"started-{os.getpid()}").touch()  # the socket arrived: the parent may close its copy
    raise SystemExit(main(argv, sockets=[sock]))


def threads_per_worker(workers: int) -> int:
    """Intra-op threads per worker when TORCH_THREADS is not set: 0 (torch's default) for one worker or where the
    operator set OMP_NUM_THREADS / MKL_NUM_THREADS, else the CPUs this process may use shared out. Each worker would
    otherwise take every core, and on the CPU their matmuls would fight over them (the CPU workers measurement in
    docs/performance.md)."""
    if workers <= 1 or os.environ.get("OMP_NUM_THREADS") or os.environ.get("MKL_NUM_THREADS"):
        return 0
    return max(1, usable_cpus() // workers)
