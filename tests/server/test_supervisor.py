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
