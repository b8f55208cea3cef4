"""The workers' parent (server.workers._Supervisor) when a ready worker dies: the other workers' readiness probe must
never see fewer ready workers than the count it is held to, however a probe falls between the parent's steps."""

from __future__ import annotations

import shutil
import types
from pathlib import Path

from fusedserve.server import workers
from fusedserve.server.devices import Placement


def test_a_dead_workers_marker_goes_only_after_the_count_drops(monkeypatch):
    for name in (workers.STATE_ENV, "FUSEDSERVE_WORKERS", "PROMETHEUS_MULTIPROC_DIR"):
        # The supervisor writes them into os.environ. delenv of an absent name records nothing, so set first: the
        # variable is then removed after the test, and later servers started by this pytest process do not inherit
        # a metrics directory that no longer exists.
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    supervisor = workers._Supervisor([Placement("cpu", "cpu")] * 2, [], "127.0.0.1", 0, target=None)
    try:
        for pid, slot in zip((1_000_001, 1_000_002), supervisor.slots):
            slot.process = types.SimpleNamespace(pid=pid, exitcode=-9)
            slot.ready = slot.handed_over = True
            (supervisor.state / f"ready-{pid}").touch()
        assert workers.all_ready()
        seen = []
        unlink = Path.unlink

        def probed_unlink(path, missing_ok=False):
            seen.append(workers.all_ready())  # a probe just before the marker goes
            unlink(path, missing_ok=missing_ok)
            seen.append(workers.all_ready())  # and just after

        monkeypatch.setattr(Path, "unlink", probed_unlink)
        supervisor._exited(supervisor.slots[0], supervisor.slots[0].process)
        monkeypatch.setattr(Path, "unlink", unlink)
        assert seen and all(seen), seen
        assert workers.all_ready()  # after: one ready of one counted
        assert supervisor.slots[0].restart_at is not None  # and it is started again
    finally:
        for slot in supervisor.slots:
            if slot.sock is not None:
                slot.sock.close()
        shutil.rmtree(supervisor.state, ignore_errors=True)


def test_the_restart_policy_workers_and_engines_share():
    """workers.Restarts: a ready process's exit is started again at once (the shortest delay); a failed start is
    tried again only in a slot that was ever ready, with longer delays, and not after FAILED_STARTS in a row."""
    first = workers.Restarts()
    first.spawned()
    assert first.exited(100.0) is None  # failed at the first start: never started again
    slot = workers.Restarts()
    slot.seen_ready()
    assert slot.exited(100.0) == workers.RESTART_DELAY_S[0] and slot.restart_at == 100.0 + workers.RESTART_DELAY_S[0]
    assert not slot.due(100.0) and slot.due(100.0 + workers.RESTART_DELAY_S[0]) and slot.restart_at is None
    delays = []
    for _ in range(workers.FAILED_STARTS):
        slot.spawned()
        delays.append(slot.exited(200.0))
    assert delays == [*workers.RESTART_DELAY_S[1:workers.FAILED_STARTS], None]
    again = workers.Restarts()
    again.seen_ready()
    again.exited(0.0)
    again.spawned()
    again.exited(0.0)  # one failed start, then a ready one: the count starts over
    again.seen_ready()
    assert again.failed_starts == 0 and again.exited(0.0) == workers.RESTART_DELAY_S[0]


def test_an_engine_follows_the_same_policy(monkeypatch, tmp_path):
    (tmp_path / "metrics").mkdir()
    engines = workers.EngineProcesses(["cpu"], "info")
    engines.state = tmp_path
    spawned = []
    monkeypatch.setattr(engines, "_spawn", lambda i: spawned.append(i))

    def running(pid: int, code: int | None):
        return types.SimpleNamespace(pid=pid, poll=lambda: code)

    engines.processes[0] = running(1_000_003, None)
    (tmp_path / "engine-ready-1000003").touch()
    assert engines.watch() is None and engines.restarts[0].ready  # seen ready
    engines.processes[0] = running(1_000_003, -9)
    assert engines.watch() is None and engines.restarts[0].restart_at is not None  # exited after ready: restarted
    engines.restarts[0].restart_at = 0.0
    assert engines.watch() is None and spawned == [0]
    for _ in range(workers.FAILED_STARTS - 1):  # its replacements fail to start
        engines.processes[0] = running(1_000_004, 3)
        assert engines.watch() is None
        engines.restarts[0].restart_at = None
    engines.processes[0] = running(1_000_004, 3)
    assert engines.watch() == 3  # the FAILED_STARTS-th in a row stops the server with its exit code
