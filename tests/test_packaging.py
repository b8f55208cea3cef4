"""Install-level checks: the CLI works, and our top-level `kernels` package does not fool transformers
into thinking the HF `kernels` hub package is installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.tolerances import assert_unit_length


def test_transformers_does_not_mistake_our_kernels_package():
    from transformers.utils import import_utils

    from fusedserve import kernels

    assert kernels.__file__  # ours is importable...
    assert not import_utils.is_kernels_available()  # ...and transformers still sees no HF `kernels`


def test_cli_embeds_text():
    result = subprocess.run(
        [sys.executable, "-m", "fusedserve", "embed", "A man is eating food.", "hello"],
        capture_output=True, text=True, timeout=120, check=True,
        env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},  # as a user runs it
    )
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["text"] for r in rows] == ["A man is eating food.", "hello"]
    assert all(r["dim"] == 384 for r in rows)
    assert_unit_length([r["embedding"] for r in rows])
    assert "model all-MiniLM-L6-v2" in result.stderr and "kernel backends" in result.stderr
    assert "rejected triton for every op: unavailable: needs a CUDA device" in result.stderr
