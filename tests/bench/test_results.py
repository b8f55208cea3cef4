"""bench.results: the one results format. The committed files validate against it; a run's header says what ran it;
writing a scenario keeps the file's other scenarios."""

from __future__ import annotations

import json

import pytest

from bench import results as store


@pytest.mark.parametrize("path", store.committed_files(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_results_validate(path):
    doc = json.loads(path.read_text())
    assert store.validate(doc) == []
    assert doc["suite"] == path.stem and doc["gpu"] == path.parent.name


def test_results_layout_is_one_file_per_suite_per_gpu():
    files = sorted(p for p in store.RESULTS.rglob("*") if p.is_file())
    assert files == store.committed_files()  # nothing but <gpu>/<suite>.json
    assert len(files) <= 20
    assert all(p.stem in store.SUITES for p in files)


@pytest.mark.parametrize(("name", "slug"), [("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100"),
                                            ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("NVIDIA H100 80GB HBM3", "h100"),
                                            (None, "cpu")])
def test_gpu_slug(name, slug):
    assert store.gpu_slug(name) == slug


def test_header_records_what_ran_it():
    head = store.header("cpu", ["encoder", "tiny-b3-varlen", "--device", "cpu"])
    assert set(store.HEADER_KEYS) <= set(head)
    assert head["command"] == "python -m bench encoder tiny-b3-varlen --device cpu"
    assert len(head["git_sha"]) == 40 and isinstance(head["git_dirty"], bool)  # this checkout's commit
    assert head["torch"] and head["host"]["cores"] >= 1
    assert head["gpu"] is None and head["clocks"] is None  # no GPU here


def _block(value: float, complete: bool = True) -> dict:
    head = store.header("cpu", ["serve", "single"])
    return store.block(head, {"x": 1}, [{"client": "httpx", "p50_ms": value}], {"note": "n"}, complete=complete)


def test_write_replaces_a_scenario_and_keeps_the_others(tmp_path):
    path = tmp_path / "cpu" / "serve.json"
    store.write(path, "serve", "cpu", "single", _block(1.0))
    store.write(path, "serve", "cpu", "soak", _block(2.0, complete=False))
    store.write(path, "serve", "cpu", "single", _block(3.0))
    doc = store.load(path)
    assert store.validate(doc) == []
    assert list(doc["scenarios"]) == ["single", "soak"]
    assert doc["scenarios"]["single"]["results"][0]["p50_ms"] == 3.0
    assert doc["scenarios"]["soak"]["complete"] is False
    # another suite's file at that path is replaced, not merged
    store.write(path, "encoder", "cpu", "tiny-b3-varlen",
                store.block(store.header("cpu", ["encoder"]), {}, [{"provider": "ours", "ms": 1.0}]))
    assert list(store.load(path)["scenarios"]) == ["tiny-b3-varlen"]


def test_validate_names_what_is_wrong():
    doc = {"schema": store.SCHEMA, "suite": "kernels", "gpu": "h200",
           "scenarios": {"fused-ops": {"header": {"date": "yesterday"}, "settings": {}, "summary": {},
                                       "results": [{"op": "layer_norm"}, {"op": "x", "error": "failed"}],
                                       "complete": True}}}
    errors = store.validate(doc)
    assert any("header lacks" in e for e in errors) and any("YYYY-MM-DD" in e for e in errors)
    assert any("results[0] lacks" in e for e in errors) and not any("results[1]" in e for e in errors)
    assert store.validate({"schema": "other"}) != []
