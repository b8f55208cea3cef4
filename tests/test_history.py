"""The tree is the product, not a diary: no work-period numbers, run names or dated file names in tracked files
(history lives in git log and CHANGELOG.md, by version and topic), and no measured figures cited from result files
in code comments (the why belongs in the comment, the number in the benchmark results and docs/performance.md)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

HISTORY = {
    "a work-period number": re.compile(r"\b(?:[Ss]ession|[Ww]ork[- ]period|[Ss]print) \d+\b"),
    "a work-period shorthand": re.compile(r"\(s\d{1,2}\)|\bs\d{1,2}[- ](?:before|after|run|defaults)\b"),
    "a run name": re.compile(r"\b(?:run|next)\d+\b"),
}
DATED_NAME = re.compile(r"(?:^|/)[^/]*\d{4}-\d{2}-\d{2}[^/]*$")
TAGGED_NAME = re.compile(r"(?:^|/)[^/]*-s\d{1,2}(?:[-.][^/]*)?$")
CODE = {".py", ".sh", ".cu", ".cuh", ".cpp", ".h", ".yaml", ".yml", ".toml"}
# a measured figure (a time or a bandwidth) on a line of code, a comment or a docstring, beside a GPU's name or a
# result file: what goes stale when the kernels change
_FIGURE = r"\d+(?:\.\d+)?\+? ?(?:us|ms|TB/s|GB/s)\b"  # "40 ms", "40+ ms", "3.4 TB/s"
_SOURCE = r"(?:\bH[12]00\b|bench/results/\S+\.json)"
MEASURED_IN_COMMENT = re.compile(rf"{_FIGURE}.*{_SOURCE}|{_SOURCE}.*{_FIGURE}")


def tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [p for p in out.splitlines() if (ROOT / p).is_file()]


def _text(path: str) -> str | None:
    try:
        return (ROOT / path).read_text()
    except (UnicodeDecodeError, OSError):
        return None  # binary (plots, archives)


def test_no_history_in_tracked_files():
    found = []
    for path in tracked():
        if DATED_NAME.search(path) or TAGGED_NAME.search(path):
            found.append(f"{path}: a dated or run-tagged file name")
        text = _text(path)
        if text is None:
            continue
        for line_no, line in enumerate(text.splitlines(), 1):
            for what, pattern in HISTORY.items():
                if pattern.search(line):
                    found.append(f"{path}:{line_no}: {what}: {line.strip()[:120]}")
    assert not found, "history belongs in git log and CHANGELOG.md:\n" + "\n".join(found[:40])


def test_no_measured_figures_in_code_comments():
    found = []
    for path in tracked():
        if Path(path).suffix not in CODE or path == "tests/test_history.py":
            continue
        text = _text(path) or ""
        for line_no, line in enumerate(text.splitlines(), 1):
            if MEASURED_IN_COMMENT.search(line):
                found.append(f"{path}:{line_no}: {line.strip()[:120]}")
    assert not found, "measured numbers live in bench/results and docs/performance.md:\n" + "\n".join(found[:40])


def test_the_patterns_catch_what_they_are_for():
    """The test cannot pass vacuously: each pattern flags a sample of what it forbids and spares ordinary text."""
    # the samples are assembled, so this file holds none of what it forbids
    assert HISTORY["a work-period number"].search("measured in " + "session" + " 13")
    assert HISTORY["a work-period shorthand"].search("0.140 ms (s" + "14)")
    assert HISTORY["a run name"].search("results of run" + "3") and HISTORY["a run name"].search("mode next" + "7")
    assert DATED_NAME.search("bench/results/2026-11-30-h200-encoder.json")
    assert TAGGED_NAME.search("bench/results/encoder-minilm-s7.json")
    assert MEASURED_IN_COMMENT.search("x = 1  # 7.3 us on the H200")
    assert MEASURED_IN_COMMENT.search("# 2.71 TB/s (bench/results/h200/kernels.json)")
    assert not MEASURED_IN_COMMENT.search("#   kernels  python -m bench kernels -> bench/results/<gpu>/kernels.json")
    for ordinary in ("MiniLM b1 s16 (batch 1, 16 tokens)", "def run(rows):", "for attempt in range(3):",
                     "Call 555-0100 before 23:59"):
        assert not any(p.search(ordinary) for p in HISTORY.values()), ordinary
