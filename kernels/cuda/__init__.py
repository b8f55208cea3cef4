"""CUDA C++ implementations of the fused ops: kernels in csrc/*.cu (CUDA headers only), torch glue in
csrc/binding.cpp, a cached JIT build (build.py), the launch-configuration tuner (tuning.py) and the per-op
launchers (launchers.py). Importing this package builds nothing; `load()` builds or loads the extension."""

from __future__ import annotations

from fusedserve.kernels.cuda.build import BuildUnavailable


def load(verbose: bool = False) -> dict:
    """Build or load the extension and return {op name: launcher}."""
    from fusedserve.kernels.cuda import build

    build.load(verbose=verbose)
    from fusedserve.kernels.cuda.launchers import LAUNCHERS

    return LAUNCHERS


__all__ = ["BuildUnavailable", "load"]
