"""The tree is the product, not a diary: no work-period numbers, run names or dated file names in tracked files
(history lives in git log and CHANGELOG.md, by version and topic), and no measured figures in code comments and
docstrings: times and bandwidths cited from result files, and the sizes, shares and counts a run measured (the why
belongs in the comment, the number in the benchmark results, docs/performance.md or a decision in docs/decisions/)."""

from __future__ import annotations

import io
import re
import subprocess
import tokenize
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
# what a run measured, in a comment or a docstring, with or without a source: a size, a share or a count that reads as
# an outcome ("stayed ~600 MB above", "+35 MB", "12% faster", "4% of the loop", "21,000 connections").
# A size or a share that defines something stays (a limit "of 64 MiB", "at most 25% filler", "within 10%", "5% of
# batches"), and so does a count that sets up a test ("4,096 tokens"): what marks a measurement is an approximation
# or a sign before a size, a verb of outcome, a comparison after a size or a share, or a count of events.
_NUMBER = r"\d[\d,]*(?:\.\d+)?"
_SIZE = rf"{_NUMBER} ?[KMGT]i?B\b"
_OUTCOME = r"took|stayed|grew|rose|fell|dropped|peaked|reached|used|leaked|saved|freed|kept|costs?"
_EVENTS = (r"requests|connections|calls|samples|errors|failures|mismatches|timeouts|retries|restarts|allocations"
           r"|recompiles|recompilations|file descriptors")
MEASURED_OUTCOME = re.compile("|".join((
    rf"[~≈+] ?{_SIZE}",                                                      # "~600 MB", "+35 MB"
    rf"\b(?:{_OUTCOME})\b[^.;:()]{{0,24}}?{_SIZE}",                          # "took 465 MB"
    rf"{_SIZE} (?:above|below|more|less|over|under) (?:its|the|their|a|what|idle|baseline)\b",
    rf"{_NUMBER} ?% (?:faster|slower|quicker|more|less|lower|higher|better|worse|off"
    rf"|of (?:the|its|their|a|an|each|all)\b)",
    rf"\b\d{{1,3}}(?:,\d{{3}})+ (?:such |more |fewer |open |concurrent |failed |idle |slow )?(?:{_EVENTS})\b",
)))


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


def commentary(path: str, text: str) -> list[tuple[int, str]]:
    """(line number, text) of a file's comments and docstrings: in Python its comments and the strings that stand as
    statements, elsewhere every line (shell, YAML and TOML files are mostly comments, C++ and CUDA sources hold few
    strings)."""
    if not path.endswith(".py"):
        return list(enumerate(text.splitlines(), 1))
    found: list[tuple[int, str]] = []
    previous = tokenize.NEWLINE
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.COMMENT:
                found.append((token.start[0], token.string))
            elif token.type == tokenize.STRING and previous in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
                found += [(token.start[0] + i, line) for i, line in enumerate(token.string.splitlines())]
            if token.type not in (tokenize.NL, tokenize.COMMENT):
                previous = token.type
    except (tokenize.TokenError, SyntaxError):
        return list(enumerate(text.splitlines(), 1))
    return found


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


def test_no_measured_outcomes_in_comments_or_docstrings():
    found = []
    for path in tracked():
        if Path(path).suffix not in CODE or path == "tests/test_history.py":
            continue
        for line_no, line in commentary(path, _text(path) or ""):
            if MEASURED_OUTCOME.search(line):
                found.append(f"{path}:{line_no}: {line.strip()[:120]}")
    assert not found, ("measured sizes, shares and counts live in bench/results, docs/performance.md or a decision in "
                       "docs/decisions/ (the comment keeps the why and names it):\n" + "\n".join(found[:40]))


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
    for measured in ("# the flood still took 465 MB", "a process stayed ~600 MB above its idle size", "# +35 MB",
                     "# it grew to 1.2 GB", "# 598 MB above its idle RSS", "# 12% faster at b32",
                     "# cost ~4% of the loop", "the router 12% of the samples", "# 21,000 such connections",
                     "after 3,000 requests"):
        assert MEASURED_OUTCOME.search(measured), measured
    for setting in ("MAX_BODY = 64 * 1024 * 1024  # 64 MiB: a whole thread heap", "# up to 64 MiB, a whole heap",
                    "# fixed at 8 and 32 MiB", "# (16384 x 30522 in fp16 is 1 GB)", "# at most 25% filler",
                    "# within 10% of what it was", "# checked on 5% of batches", "# an input of 4,096 tokens",
                    "# 1,000 dims of 4,000 digits each", "# 2 x 128 KB of accumulators"):
        assert not MEASURED_OUTCOME.search(setting), setting
    # comments and docstrings, not code: a log line's or an assertion's text is not a comment
    sample = 'x = f"{n}% of the loop"  # a setting\n\n\ndef f():\n    """It took 5 MB."""\n    return "took 5 MB"\n'
    assert [line for _, line in commentary("m.py", sample)] == ["# a setting", '"""It took 5 MB."""']
