"""WORKERS=N: N server processes on one port, each with its own listening socket and its own models on the same
device.

One Python process is host-bound long before an H200 is busy (its event loop parses, tokenizes and answers every
request), so the throughput of one GPU comes from several processes feeding it, as replicas under CUDA MPS did by
hand. The parent binds one socket per worker on the port (SO_REUSEPORT) and spawns the workers (spawn, not fork:
CUDA must not be initialized in a forked child); the kernel spreads new connections over the sockets by a hash of
each. With one shared socket a worker that woke accepted every connection waiting (asyncio takes the whole backlog at
once), and keep-alive clients stay where they land: 64 clients landed 49/13/2/0 on 4 workers, and the busiest worker
capped the throughput of all. With the CUDA MPS daemon running (docs/operations.md) their kernels share the GPU
concurrently instead of time-slicing.

- Start: on a GPU the first worker loads alone and fills the kernel cache (compiles, autotuning, races); the others
  load once it is ready, from the cache. On the CPU, where nothing is compiled or raced, they all load at once.
- Readiness: a worker answers /readyz 200 only once every worker is ready (each marks itself in the shared state
  directory), so a probe never sees a pod ready whose next connection lands on a worker still loading.
- Metrics: prometheus-client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR, one directory per start): any worker's
  /metrics answers for all of them, counters and histograms summed, gauges as each declares (server.metrics). The
  alternative, a `worker` label per process, would leave each scrape with one worker's numbers.
- Failure: a worker that exits stops the others and the parent exits non-zero (the failing worker's code, 1 for a
  model that failed to load); the orchestrator restarts the pod (a half-serving pod with a dead worker would be
  slower than it reports).
- Signals: SIGTERM or SIGINT on the parent sends SIGTERM to every worker (each in its own process group, so it gets
  one signal, not the terminal's too), and each drains as a single server does.
- The admin fused switch answers 409: a request reaches one worker of several.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path

log = logging.getLogger("fusedserve")

STATE_ENV = "FUSEDSERVE_WORKERS_STATE"  # the shared state directory, set by the parent for its workers
INDEX_ENV = "FUSEDSERVE_WORKER_INDEX"  # this worker's number, 0 for the first


def state_dir() -> Path | None:
    """The workers' shared directory, or None in a single-process server."""
    value = os.environ.get(STATE_ENV)
    return Path(value) if value else None


def mark_ready() -> None:
    """This worker is ready (no-op in a single-process server)."""
    directory = state_dir()
    if directory is not None:
        (directory / f"ready-{os.getpid()}").touch()


def wait_for_the_first() -> None:
    """Workers after the first wait until it is ready before they load: the first compiles, tunes and races the
    kernels into the cache directory, and the others then take all of it from there in seconds, instead of every
    worker autotuning and timing races on one GPU beside the others' start-up work (noisy races could make workers
    choose different backends). No-op in a single-process server and in the first worker."""
    directory = state_dir()
    if directory is None or os.environ.get(INDEX_ENV, "0") == "0":
        return
    log.warning("worker %s: waiting for the first worker to be ready (it fills the kernel cache)",
                os.environ[INDEX_ENV])
    while not any(directory.glob("ready-*")):
        time.sleep(0.2)


def all_ready() -> bool:
    """Every worker of this server is ready (True in a single-process server: the caller checks its own state)."""
    directory = state_dir()
    if directory is None:
        return True
    return len(list(directory.glob("ready-*"))) >= int(os.environ.get("FUSEDSERVE_WORKERS", "1"))


def bind(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
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


def supervise(count: int, argv: list[str], host: str, port: int, target) -> int:
    """Bind host:port, run `target(argv, sock, index)` in `count` spawned processes, and wait: the first worker to exit
    stops the others. Returns 0 when a signal stopped them and each ended cleanly; else the first failure's code
    (1 for a worker killed by a signal nobody sent through the parent)."""
    state = Path(tempfile.mkdtemp(prefix="fusedserve-workers-"))
    (state / "metrics").mkdir()
    os.environ.update({STATE_ENV: str(state), "FUSEDSERVE_WORKERS": str(count),
                       "PROMETHEUS_MULTIPROC_DIR": str(state / "metrics")})
    sockets = bind_each(host, port, count)
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=target, args=(argv, sock, i), name=f"fusedserve-worker-{i}", daemon=False)
               for i, sock in enumerate(sockets)]
    signalled = False

    def stop_all() -> None:  # SIGTERM whatever the parent got: each worker drains as a single server does
        for worker in workers:
            if worker.pid is not None and worker.is_alive():
                os.kill(worker.pid, signal.SIGTERM)

    def on_signal(signum, frame) -> None:
        nonlocal signalled
        signalled = True
        stop_all()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for worker in workers:
            if signalled:
                break
            worker.start()
        started = [w for w in workers if w.pid is not None]
        log.warning("%d workers on http://%s:%d (pids %s)", len(started), host, port,
                    " ".join(str(w.pid) for w in started))
        while not signalled and all(worker.is_alive() for worker in started):
            time.sleep(0.2)
        first = next((w for w in started if not w.is_alive()), None)
        unexpected = not signalled and first is not None
        if unexpected:
            log.critical("worker %s (pid %d) exited with %s; stopping the others", first.name, first.pid,
                         first.exitcode)
        stop_all()
        for worker in started:
            worker.join()
        if unexpected:
            return first.exitcode if first.exitcode and first.exitcode > 0 else 1
        # after the parent's SIGTERM a worker ends by it (uvicorn re-raises the signal once it has shut down)
        failed = [w.exitcode for w in started if w.exitcode not in (0, -signal.SIGTERM)]
        return next((code for code in failed if code > 0), 1) if failed else 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sock in set(sockets):
            sock.close()
        shutil.rmtree(state, ignore_errors=True)


def run_worker(main, argv: list[str], sock: socket.socket, index: int) -> None:
    """A worker process: `main(argv, sockets=[sock])` (the same start as `fusedserve serve`, on the parent's socket;
    the serve command hands its own main in, so this module never imports it). In a process group of its own, so a
    terminal's Ctrl-C or a service manager's group-wide signal reaches it once, through the parent."""
    os.setpgrp()
    os.environ[INDEX_ENV] = str(index)
    raise SystemExit(main(argv, sockets=[sock]))


def threads_per_worker(workers: int) -> int:
    """Intra-op threads per worker when TORCH_THREADS is not set: 0 (torch's default) for one worker or where the
    operator set OMP_NUM_THREADS / MKL_NUM_THREADS, else the CPUs this process may use shared out. Each worker would
    otherwise take every core, and on the CPU their matmuls would fight over them (the CPU workers measurement in
    docs/performance.md)."""
    if workers <= 1 or os.environ.get("OMP_NUM_THREADS") or os.environ.get("MKL_NUM_THREADS"):
        return 0
    return max(1, _usable_cpus() // workers)


def _usable_cpus() -> int:
    """This process's CPU affinity, capped by a cgroup v2 CPU quota (a container's limit, where the affinity still
    lists every core of the node)."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]  # "max 100000" or "200000 100000"
        return cpus if quota == "max" else min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        return cpus
