"""The CPU backend: the fused ops a CPU serves faster than the reference composes them, built from ATen's own CPU
kernels (MKL/oneDNN GEMMs that take the bias as their C operand, one-pass in-place GELU and LayerNorm). Nothing to
compile or tune: the registry self-tests it against the float64 reference like every fused backend."""

import importlib

from fusedserve.kernels.spec import launcher_modules

# {op: launcher} for the ops kernels.spec lists as implemented on the CPU, each found where the spec says it lives
LAUNCHERS = {op: getattr(importlib.import_module(f"{__name__}.{module}"), op)
             for op, module in launcher_modules("cpu").items()}
