"""The tuning tables a start reuses (kernels.cache): Triton's chosen configs saved and seeded back without
benchmarking, the shipped table per GPU model taken only for the kernel sources and switches it was made from, and
the export that writes it from a cache directory. On the CPU: the Triton interpreter's autotuner, a stand-in GPU
name."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import pytest
import torch

from fusedserve import kernels
from fusedserve.kernels import cache, registry
from fusedserve.kernels.cuda import tuning
from tests.kernels._shared import cache_directory

GPU = "test-gpu-h200"


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """An empty cache directory and shipped folder, and a GPU name for the tables (no CUDA needed)."""
    monkeypatch.setattr(cache, "SHIPPED", tmp_path / "shipped")
    monkeypatch.setattr(cache, "gpu_name", lambda device=None: "Test GPU H200")
    monkeypatch.setattr(cache, "_shipped_said", set())
    for name in cache.SWITCHES:
        monkeypatch.delenv(name, raising=False)
    with cache_directory(tmp_path / "cache"):
        yield tmp_path


def _ship(dirs, tables: dict, **overrides) -> None:
    body = {"gpu": GPU, "sources": cache.sources_hash(), "switches": cache.switches(), "tables": tables, **overrides}
    (dirs / "shipped").mkdir(exist_ok=True)
    (dirs / "shipped" / f"{GPU}.json").write_text(json.dumps(body))


RACES = {"layer_norm|float16|384|256": {"us": {"triton": 3.5, "cuda": 4.25}, "how": "device"}}
CUDA_TUNING = {"norm|float16|384|1024": {"config": [2, 128], "us": 5.0, "heuristic_us": 6.0, "candidates": 4}}


def test_the_cache_directory_comes_as_an_argument_with_the_environment_as_fallback(tmp_path, monkeypatch):
    """kernels.configure(cache_dir=...) (the model layer passes the service's setting) wins over FUSEDSERVE_CACHE_DIR,
    the kernel layer's fallback for standalone use, and None goes back to it; every table follows. Triton's cache
    follows where the kernel layer chose it; a TRITON_CACHE_DIR the user set stays."""
    monkeypatch.setattr(cache, "_configured", None)  # whatever configured the process before: back after the test
    monkeypatch.setattr(cache, "_triton_dir", None)
    monkeypatch.delenv(cache.TRITON_ENV, raising=False)  # restored after the test, whatever this test sets
    monkeypatch.setenv(cache.ENV, str(tmp_path / "env"))
    monkeypatch.setattr(cache, "gpu_name", lambda device=None: "Test GPU H200")
    assert cache.root() == tmp_path / "env"
    cache.use_for_triton()  # the Triton backend's load
    assert os.environ[cache.TRITON_ENV] == str(tmp_path / "env" / "triton")
    kernels.configure(cache_dir=str(tmp_path / "configured"))
    assert cache.root() == tmp_path / "configured"
    assert {cache.gpu_file(table).parent for table in cache.TABLES} == {tmp_path / "configured"}
    assert os.environ[cache.TRITON_ENV] == str(tmp_path / "configured" / "triton")
    kernels.configure(cache_dir="")  # an empty setting: unconfigured
    assert cache.root() == tmp_path / "env" and os.environ[cache.TRITON_ENV] == str(tmp_path / "env" / "triton")
    monkeypatch.setenv(cache.TRITON_ENV, str(tmp_path / "users"))
    kernels.configure(cache_dir=str(tmp_path / "again"))
    cache.use_for_triton()
    assert cache.root() == tmp_path / "again" and os.environ[cache.TRITON_ENV] == str(tmp_path / "users")
    monkeypatch.delenv(cache.ENV)
    kernels.configure(cache_dir=None)
    assert cache.root() == Path.home() / ".cache" / "fusedserve"


def test_the_tuning_command_takes_the_cache_directory_as_an_argument(tmp_path, monkeypatch, capsys):
    from fusedserve.kernels.tuning.__main__ import main

    monkeypatch.setattr(cache, "_configured", None)  # whatever configured the process before: back after the test
    monkeypatch.setenv(cache.ENV, str(tmp_path / "env"))
    assert main(["where", "--cache-dir", str(tmp_path / "given")]) == 0
    assert main(["where"]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "given"), str(tmp_path / "env")]


def test_the_shipped_table_is_taken_for_its_sources_and_switches_only(dirs, monkeypatch, caplog):
    _ship(dirs, {"races": RACES, "tuning": CUDA_TUNING, "triton": {}})
    assert cache.shipped("races") == RACES and cache.shipped("tuning") == CUDA_TUNING

    monkeypatch.setenv("FUSEDSERVE_TRITON_AUTOTUNE", "0")  # tuned with autotuning on: not for this start
    with caplog.at_level(logging.WARNING, logger="fusedserve.kernels"):
        assert cache.shipped("races") == {}
    assert "made from other kernel sources or switches" in caplog.text

    monkeypatch.delenv("FUSEDSERVE_TRITON_AUTOTUNE")
    _ship(dirs, {"races": RACES}, sources="0" * 16)  # edited kernels: their old choices are not shipped
    assert cache.shipped("races") == {}
    (dirs / "shipped" / f"{GPU}.json").write_text("{not json")
    assert cache.shipped("races") == {}  # unreadable: reported, ignored


def _edited(*names: str, added: str = "") -> dict[str, str]:
    """The file hashes of a tree where `names` differed from this one and `added` did not exist yet."""
    files = {name: ("0" * 16 if name in names else digest) for name, digest in cache.source_hashes().items()}
    files.pop(added, None)
    return files


def test_a_shipped_file_made_before_an_edit_keeps_the_entries_the_edit_does_not_touch(dirs, caplog):
    """Each entry depends on the files it was measured on: a Triton config on its kernel's module and what that
    imports, a CUDA launch config on the extension, a race on each raced backend's launcher of the op, and all of
    them on the shared row buckets, op specs and race. A kernel added or edited since the export voids only the
    entries measured on it, and the start says which files changed."""
    races = {"linear_bias_gelu|float16|4096|1536|triton,cuda|device": {"us": {"triton": 20.0, "cuda": 22.0},
                                                                         "how": "device"},
             "segment_mean|float16|4096|384|triton,cuda|device": {"us": {"triton": 3.0, "cuda": 4.0}, "how": "device"},
             "layer_norm|float16|384|256": {"us": {"triton": 3.5}, "how": "device"}}  # another layout: never taken
    triton_table = {name: {"[384]": {"kwargs": {"BLOCK_M": 4}, "num_warps": 4, "num_stages": 3}}
                    for name in ("_norm_kernel", "_linear_gelu_kernel", "_gone_kernel")}
    tables = {"races": races, "tuning": CUDA_TUNING, "triton": triton_table}
    made_with = {"triton": cache._triton_version()}

    def shipped_after(files: dict[str, str]) -> dict[str, set[str]]:
        _ship(dirs, tables, sources="0" * 16, source_files=files, made_with=made_with)
        return {name: set(cache.shipped(name)) for name in cache.TABLES}

    with caplog.at_level(logging.WARNING, logger="fusedserve.kernels"):
        # a new kernel file and an offline tool edited: nothing shipped was measured on either
        assert shipped_after(_edited("triton/compile_check.py", added="triton/fp8.py")) == {
            "races": set(races) - {"layer_norm|float16|384|256"}, "tuning": set(CUDA_TUNING),
            "triton": {"_norm_kernel", "_linear_gelu_kernel"}}
        assert shipped_after(_edited("triton/linear_gelu.py")) == {
            "races": {"segment_mean|float16|4096|384|triton,cuda|device"}, "tuning": set(CUDA_TUNING),
            "triton": {"_norm_kernel"}}
        assert "made before edits to triton/linear_gelu.py" in caplog.text
        assert shipped_after(_edited("triton/_common.py")) == {"races": set(), "tuning": set(CUDA_TUNING),
                                                               "triton": set()}
        assert shipped_after(_edited("cuda/csrc/norm.cu")) == {
            "races": set(), "tuning": set(), "triton": {"_norm_kernel", "_linear_gelu_kernel"}}
        assert shipped_after(_edited("spec.py")) == {name: set() for name in cache.TABLES}


def test_a_start_without_its_own_tables_begins_from_the_shipped_ones(dirs, monkeypatch):
    local_race = {"bias_gelu|float16|1536|256": {"us": {"triton": 2.0, "cuda": 2.5}, "how": "device"}}
    _ship(dirs, {"races": {**RACES, "bias_gelu|float16|1536|256": {"us": {"triton": 9.0}, "how": "device"}},
                 "tuning": CUDA_TUNING})
    assert cache.write_table(cache.gpu_file("races"), local_race) is None
    monkeypatch.setattr(registry, "_saved", {})
    saved = registry._saved_races(torch.device("cuda"))
    assert saved == {**RACES, **local_race}  # the machine's own timing wins over the shipped one

    tuner = tuning.Tuner()
    tuner._cache_file()
    assert tuner.table() == CUDA_TUNING


def test_export_writes_the_cache_directory_tables_for_this_gpu(dirs):
    with pytest.raises(SystemExit, match="nothing to export"):
        cache.export()
    triton_table = {"_norm_kernel": {json.dumps([384, 256, False, "torch.float16"]): {
        "kwargs": {"BLOCK_M": 4}, "num_warps": 4, "num_stages": 3, "num_ctas": 1, "maxnreg": None}}}
    for prefix, table in (("races", RACES), ("tuning", CUDA_TUNING), ("triton", triton_table)):
        assert cache.write_table(cache.gpu_file(prefix), table) is None
    path = cache.export()
    assert path == dirs / "shipped" / f"{GPU}.json"
    body = json.loads(path.read_text())
    assert body["sources"] == cache.sources_hash() and body["switches"] == cache.switches()
    assert body["source_files"] == cache.source_hashes()
    assert body["made_with"]["torch"] == torch.__version__
    assert {name: cache.shipped(name) for name in cache.TABLES} == {
        "races": RACES, "tuning": CUDA_TUNING, "triton": triton_table}

    # a start that took part of the shipped file tuned and saved only the rest: the export keeps both
    kept = {"segment_mean|float16|4096|384|triton,cuda|device": {"us": {"triton": 3.0, "cuda": 4.0}, "how": "device"}}
    _ship(dirs, {"races": kept}, sources="0" * 16, source_files=_edited("triton/fp8.py"))
    body = json.loads(cache.export().read_text())
    assert body["tables"]["races"] == {**kept, **RACES} and body["source_files"] == cache.source_hashes()


def test_triton_choices_are_saved_and_seeded_back_without_benchmarking(monkeypatch):
    from fusedserve.kernels.triton import LAUNCHERS, _common

    tuner = _common.TUNERS["_norm_kernel"]
    monkeypatch.setattr(tuner, "cache", {})
    x = torch.randn(37, 384, generator=torch.Generator().manual_seed(1))
    w, b = torch.randn(384), torch.randn(384)
    want = LAUNCHERS["layer_norm"](x, w, b, 1e-12)
    table = _common.tuning_table()
    assert table["_norm_kernel"], "the launch tuned no key: the test would prove nothing"
    chosen = dict(tuner.cache)

    monkeypatch.setattr(tuner, "cache", {})  # a new process: only the table remains
    assert _common.seed_tuning(json.loads(json.dumps(table))) == len(chosen)
    assert _common.seed_tuning(table) == 0  # keys already there are kept
    assert {k: (c.kwargs, c.num_warps, c.num_stages) for k, c in tuner.cache.items()} == {
        k: (c.kwargs, c.num_warps, c.num_stages) for k, c in chosen.items()}

    def no_bench(*args, **kwargs):
        raise AssertionError("benchmarked a key the table held")

    monkeypatch.setattr(tuner, "_bench", no_bench)
    got = LAUNCHERS["layer_norm"](x, w, b, 1e-12)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # a table from another layout of the kernels: an unknown kernel or a malformed entry is tuned again, not fatal
    assert _common.seed_tuning({"_gone_kernel": {"[1]": {}}, "_norm_kernel": {"[2]": {"kwargs": {}}}}) == 0


@pytest.mark.parametrize("path", sorted(cache.SHIPPED.glob("*.json")), ids=lambda p: p.name)
def test_each_shipped_file_is_a_whole_table_for_these_kernels(path):
    """A shipped file parses, names its GPU as its file name does, and every table holds entries of the layout the
    readers take, for kernels that exist (a stale one would be ignored at start: re-export it on that GPU after a
    kernel change, `python -m fusedserve.kernels.tuning export`)."""
    from fusedserve.kernels.triton import _common

    body = json.loads(path.read_text())
    assert path.stem == re.sub(r"[^A-Za-z0-9]+", "-", body["gpu"]).strip("-").lower()
    assert set(body["switches"]) == set(cache.SWITCHES) and len(body["sources"]) == 16
    # file by file, so that a later kernel edit voids only the entries measured on it
    assert body["source_files"] and all(len(digest) == 16 for digest in body["source_files"].values())
    assert {"spec.py", "triton/_norm.py", "cuda/csrc/norm.cu"} <= set(body["source_files"])
    tables = body["tables"]
    assert tables["races"] and registry._valid_races(tables["races"])
    assert tables["tuning"] and tuning._valid_table(tables["tuning"])
    assert tables["triton"] and set(tables["triton"]) <= set(_common.TUNERS)
    for entries in tables["triton"].values():
        for key, config in entries.items():
            assert isinstance(json.loads(key), list) and set(config) >= {"kwargs", "num_warps", "num_stages"}


def test_only_current_candidates_are_seeded_and_never_under_the_interpreter():
    from fusedserve.kernels.triton import _common

    candidate = _common.TUNERS["_norm_kernel"].configs[0]
    entry = {"kwargs": dict(candidate.kwargs), "num_warps": candidate.num_warps, "num_stages": candidate.num_stages,
             "num_ctas": candidate.num_ctas, "maxnreg": candidate.maxnreg}
    stranger = {**entry, "num_warps": 3}  # no candidate has three warps
    table = {"_norm_kernel": {"[1]": entry, "[2]": stranger}, "_gone_kernel": {"[1]": entry}}
    assert cache._candidates_only(table) == {"_norm_kernel": {"[1]": entry}}
    assert _common.INTERPRET and cache.seed_triton(torch.device("cpu")) == 0  # CPU timings never reach a GPU table
    assert cache._minor("3.6.0") == cache._minor("3.6.1") != cache._minor("3.8.0")
