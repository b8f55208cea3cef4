"""No class in model/ or server/ is over MAX_LINES lines or MAX_METHODS methods: a class that grows past either has
taken on a second duty, and is split by duty rather than let grow. Counted on the source's syntax tree: a class's
lines run from its first decorator to its last statement, and its methods are the functions defined directly in its
body (properties, class and static methods included; a nested class is a class of its own)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 250
MAX_METHODS = 20


def oversized(package: str) -> Iterator[str]:
    """'path:line Class: N lines, M methods' for each class of `package` (its folder, subfolders included) over a
    limit."""
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            lines = node.end_lineno - first + 1
            methods = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
            if lines > MAX_LINES or methods > MAX_METHODS:
                yield f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines, {methods} methods"


@pytest.mark.parametrize("package", ["model", "server"])
def test_no_class_is_over_the_size_limits(package):
    over = list(oversized(package))
    assert not over, (f"classes over {MAX_LINES} lines or {MAX_METHODS} methods in {package}/ (split them by duty):\n"
                      + "\n".join(over))

