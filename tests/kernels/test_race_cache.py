"""The backend race's timings are saved in the cache directory and a later start takes them without racing again
(the self-tests still run): on a GPU, where auto mode races."""

from __future__ import annotations

import pytest
import torch

from fusedserve import kernels
from fusedserve.kernels import registry
from tests.kernels._shared import cache_directory

pytestmark = pytest.mark.gpu


@pytest.fixture
def cache_dir(tmp_path):
    with cache_directory(tmp_path):
        yield tmp_path


def test_a_later_selection_takes_the_saved_race(cache_dir, monkeypatch):
    monkeypatch.setattr(registry, "_race_cache", {})
    monkeypatch.setattr(registry, "_saved", {})
    ops = ("layer_norm", "bias_gelu")
    first = kernels.select("cuda", (torch.float16,), hidden_sizes=(384,), ops=ops)
    assert len(list(cache_dir.glob("races-*.json"))) == 1
    monkeypatch.setattr(registry, "_race_cache", {})  # a new process: only the file remains
    monkeypatch.setattr(registry, "_saved", {})

    def no_race(*args, **kwargs):
        raise AssertionError("raced again although the timings were saved")

    monkeypatch.setattr(registry.timing_, "interleaved_us", no_race)
    tested = []
    monkeypatch.setattr(registry, "_self_test", lambda *a, **k: tested.append(a[1]) or None)
    second = kernels.select("cuda", (torch.float16,), hidden_sizes=(384,), ops=ops)
    assert set(tested) >= set(ops)  # fresh self-tests all the same
    assert {op: c.backend for op, c in second.choices.items()} == {op: c.backend for op, c in first.choices.items()}
    for op in ops:
        assert second.choices[op].timings_us == pytest.approx(first.choices[op].timings_us, abs=1e-3)
