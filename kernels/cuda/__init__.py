"""CUDA C++ implementations of the fused ops: kernels in csrc/*.cu (CUDA headers only), torch glue in
csrc/binding.cpp, a cached JIT build (build.py), the launch-configuration tuner (tuning.py) and the per-op
launchers (launchers.py). Importing this package builds nothing; `load()` builds or loads the extension."""

from __future__ import annotations

import importlib

from fusedserve.kernels.cuda.errors import BuildUnavailable
from fusedserve.kernels.spec import launcher_modules


def load(verbose: bool = False) -> dict:
    """Build or load the extension and return {op name: launcher} for the ops kernels.spec lists as implemented in
    CUDA (the launcher modules need the built extension, so they are imported only after it loaded)."""
    from fusedserve.kernels.cuda import build

    build.load(verbose=verbose)
    return {op: getattr(importlib.import_module(f"{__name__}.{module}"), op)
            for op, module in launcher_modules("cuda").items()}


__all__ = ["BuildUnavailable", "load"]
