"""Triton implementations of the fused ops, one launcher per file (see _norm.py and _pointwise.py for the
shared kernels). Importing this package imports triton; the registry does so only when probing."""

import importlib

from fusedserve.kernels.spec import launcher_modules

# {op: launcher} for the ops kernels.spec lists as implemented in Triton, each found where the spec says it lives
LAUNCHERS = {op: getattr(importlib.import_module(f"{__name__}.{module}"), op)
             for op, module in launcher_modules("triton").items()}
