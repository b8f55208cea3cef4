"""Every CUDA source compiles for Hopper (sm_90) and Ampere (sm_80) with nvcc, and ptxas reports no register
spills and no local-memory stack frame for any kernel (a spill is a performance bug in these kernels).
Needs only nvcc, no GPU."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import require_tool

SOURCES = sorted((Path(__file__).resolve().parents[2] / "kernels" / "cuda" / "csrc").glob("*.cu"))


def nvcc() -> str:
    default = "/usr/local/cuda/bin/nvcc"
    return require_tool("nvcc", "FUSEDSERVE_REQUIRE_NVCC",
                        path=shutil.which("nvcc") or (default if Path(default).exists() else None))


def test_there_are_sources():
    assert SOURCES


@pytest.mark.slow  # nvcc, each source for each architecture
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_compiles_without_spills(source, arch, tmp_path):
    result = subprocess.run([nvcc(), f"-arch={arch}", "-O3", "-std=c++17", "-Xptxas", "-v", "-c", str(source),
                             "-o", str(tmp_path / "out.o")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", result.stderr)
    functions = re.findall(r"Compiling entry function '(\w+)'", result.stderr)
    assert reports and len(reports) >= len(functions) > 0, result.stderr[-2000:]
    bad = [r for r in reports if r != ("0", "0", "0")]
    assert not bad, f"stack frames or spills (bytes of frame, spill stores, spill loads): {bad}"
