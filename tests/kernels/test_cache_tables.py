"""The cache directory's tables under replicas that share it: read-merge-write by several processes at once keeps
every process's entries (kernels.cache.merge_table holds a lock file around it)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from fusedserve.kernels import cache


def _add_entries(path: str, worker: int, rounds: int) -> None:
    for i in range(rounds):
        error = cache.merge_table(Path(path), lambda t: isinstance(t, dict), "test table",
                                  lambda table: table.update({f"{worker}-{i}": i}))
        assert error is None, error


def test_processes_merging_at_once_keep_each_others_entries(tmp_path):
    path = tmp_path / "shared" / "table.json"
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_add_entries, args=(str(path), w, 40)) for w in range(4)]
    for p in workers:
        p.start()
    for p in workers:
        p.join(timeout=120)
        assert p.exitcode == 0
    table = cache.read_table(path, lambda t: isinstance(t, dict), "test table")
    assert len(table) == 4 * 40, sorted(table)[:10]


def test_an_unwritable_directory_is_an_error_not_an_exception(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    error = cache.merge_table(blocked / "table.json", lambda t: isinstance(t, dict), "test table", lambda t: None)
    assert isinstance(error, OSError)
