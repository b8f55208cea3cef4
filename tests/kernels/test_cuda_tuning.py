"""fusedserve.kernels.cuda.tuning on the CPU: the cache file's life (a corrupt one reported and rebuilt, a missing one silent,
saves atomic through a per-process temporary file), with the GPU's name and the device timer stood in for. The
sweep on real kernels is tested on the GPU (test_cuda_ops.py)."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from fusedserve.kernels import _layout
from fusedserve.kernels.cuda import tuning
from tests.kernels._shared import cache_directory

GPU = "NVIDIA Test GPU 80GB"
FILE = "tuning-nvidia-test-gpu-80gb-sources.json"
CANDIDATES = [(256, 4), (128, 1), (512, 16)]
ROWS = 4096  # above TUNE_MIN_ROWS: a sweep


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory (kernels.configure), a named GPU and kernel-source fingerprint, and a device timer
    that runs the candidate once and says (128, 1) is fastest."""
    from fusedserve.kernels import cache as cache_dir

    monkeypatch.setattr(cache_dir, "fingerprint", lambda: "sources")
    monkeypatch.delenv("FUSEDSERVE_CUDA_TUNE", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: GPU)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    chosen = []

    def device_us(fn, **kwargs):
        assert kwargs == {"calls": 10, "rounds": 5, "reduce": "median"}  # the tuner's settings, as before
        fn()
        return {(256, 4): 9.0, (128, 1): 4.0, (512, 16): 6.0}[chosen[-1]]

    monkeypatch.setattr(tuning, "device_us", device_us)
    with cache_directory(tmp_path):
        yield tmp_path, chosen.append


def _tune(tuner: tuning.Tuner, run) -> tuple[int, int]:
    return tuner.choose("norm", torch.float16, 384, ROWS, CANDIDATES, run)


def test_a_missing_cache_is_a_first_start_no_warning(cache, caplog):
    directory, run = cache
    with caplog.at_level(logging.WARNING, logger="fusedserve.kernels.cuda"):
        assert _tune(tuning.Tuner(), run) == (128, 1)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    saved = json.loads((directory / FILE).read_text())
    assert saved == {f"norm|float16|384|{_layout.row_bucket(ROWS)}":
                     {"config": [128, 1], "us": 4.0, "heuristic_us": 9.0, "candidates": 3}}
    # no temporary file left behind; the lock file stays (removing it would race a process about to take it)
    assert sorted(p.name for p in directory.iterdir()) == [FILE, f"{FILE}.lock"]


@pytest.mark.parametrize("garbage", [b"{\"norm|float16|384|13\": {\"config\": [128", b"\xff\xfe not text",
                                     b"[1, 2, 3]", b"{\"k\": {\"config\": \"fast\"}}"],
                         ids=["truncated", "binary", "not-a-table", "bad-entry"])
def test_a_corrupt_cache_is_reported_once_and_rebuilt_by_the_next_save(cache, caplog, garbage):
    directory, run = cache
    path = directory / FILE
    path.write_bytes(garbage)
    tuner = tuning.Tuner()
    with caplog.at_level(logging.WARNING, logger="fusedserve.kernels.cuda"):
        assert _tune(tuner, run) == (128, 1)  # an empty table: swept, not read from the garbage
        tuner.choose("norm", torch.float16, 768, ROWS, CANDIDATES, run)  # a second shape: no second warning
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage()
    assert "Error" in warnings[0].getMessage()  # the exception's type and text are named
    saved = json.loads(path.read_text())  # the save replaced the garbage with the new table
    assert set(saved) == {f"norm|float16|{cols}|{_layout.row_bucket(ROWS)}" for cols in (384, 768)}
    assert tuning.Tuner().choose("norm", torch.float16, 384, ROWS, [(1, 1), (2, 2)], run) == (128, 1)  # starts tuned


def test_saves_go_through_a_per_process_temporary_file(cache, monkeypatch):
    directory, run = cache
    written = []
    real_write = type(directory).write_text

    def write_text(self, *args, **kwargs):
        written.append(self.name)
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(type(directory), "write_text", write_text)
    (directory / f"{FILE}.999999.tmp").write_bytes(b"another replica, mid-save")
    _tune(tuning.Tuner(), run)
    assert written[-1] == f"{FILE}.{os.getpid()}.tmp"  # never the shared name another process may be writing
    assert (directory / f"{FILE}.999999.tmp").read_bytes() == b"another replica, mid-save"
    assert json.loads((directory / FILE).read_text())


def test_an_unwritable_cache_is_reported_once(cache, caplog, monkeypatch):
    directory, run = cache

    def replace(self, target):
        raise PermissionError(30, "Read-only file system", str(target))

    monkeypatch.setattr(type(directory), "replace", replace)
    tuner = tuning.Tuner()
    with caplog.at_level(logging.WARNING, logger="fusedserve.kernels.cuda"):
        assert _tune(tuner, run) == (128, 1)  # tuned all the same, for this process
        tuner.choose("norm", torch.float16, 768, ROWS, CANDIDATES, run)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "cannot save" in warnings[0].getMessage()
    assert "Read-only file system" in warnings[0].getMessage()
    assert len(tuner.table()) == 2
    assert [p.name for p in directory.iterdir()] == [f"{FILE}.lock"]  # the temporary file is removed, no cache


def test_row_bucket_is_one_function_for_both_backends():
    from fusedserve.kernels.triton import _common

    assert tuning.row_bucket is _layout.row_bucket is _common.row_bucket
    assert [_layout.row_bucket(r) for r in (0, 1, 2, 3, 4, 255, 256, 4096, 5000, 2**30)] == \
        [1, 1, 2, 2, 3, 8, 9, 13, 13, 24]
