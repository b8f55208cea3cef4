"""CUDA C++ implementations of the fused ops: kernels in csrc/*.cu (CUDA headers only), torch glue in
csrc/binding.cpp, a cached JIT build (build.py), the launch-configuration tuner (tuning.py) and the per-op
launchers (launchers.py). Importing this package builds nothing; `load()` builds or loads the extension."""

from __future__ import annotations

import importlib

from fusedserve.kernels.spec import launcher_modules


class BuildUnavailable(RuntimeError):
    """The extension cannot be built or loaded here; the message says why. Defined here rather than in build.py,
    which is also the command `python -m fusedserve.kernels.cuda.build`: a package that imported its own command's
    module would have runpy execute that file a second time as __main__."""


def load(verbose: bool = False) -> dict:
    """Build or load the extension and return {op name: launcher} for the ops kernels.spec lists as implemented in
    CUDA (the launcher modules need the built extension, so they are imported only after it loaded)."""
    from fusedserve.kernels.cuda import build

    build.load(verbose=verbose)
    return {op: getattr(importlib.import_module(f"{__name__}.{module}"), op)
            for op, module in launcher_modules("cuda").items()}


__all__ = ["BuildUnavailable", "load"]
