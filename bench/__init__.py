"""Benchmarks (`python -m bench.<name>`). Every one reports the same way: a JSON file under bench/results/
holding the command that reproduces it."""

from __future__ import annotations

import json
import sys


def command(module: str, argv: list[str] | None = None) -> str:
    """`python -m bench.<module> ARGS` as this run was invoked (argv when main() was called directly)."""
    return " ".join([f"python -m bench.{module}", *(sys.argv[1:] if argv is None else argv)])


def save(report: dict, path: str | None) -> None:
    """Write the report as JSON to `path` (nothing when no --out was given)."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
