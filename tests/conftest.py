"""Shared fixtures. The tolerance table is kernels.testing.TOLERANCES (the registry's self-test uses the
same one); it is re-exported here so tests read it from one place."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU the Triton kernels run on the interpreter; it must be switched on before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from kernels.testing import TOLERANCES  # noqa: E402,F401  (the suite's one tolerance table)

# Odd widths on purpose: a single column, sub-warp, non-power-of-two, just over / under a power of two.
ODD_COLS = (1, 7, 300, 769, 1023, 4097)
ROWS = (1, 333)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


HAS_CUDA = torch.cuda.is_available()
# Kernel tests run on "cuda" on a GPU machine and on the Triton interpreter ("cpu") elsewhere.
DEVICES = [
    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
    pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA, reason="interpreter runs only where there is no GPU"),
                 id="interpreter"),
]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here); run with -m gpu on the H200")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
