"""Triton bias + GELU: GELU(x + bias)."""

from __future__ import annotations

from torch import Tensor

from fusedserve.kernels.triton._common import as_rows, as_vector, check_device, output_like
from fusedserve.kernels.triton._gelu import GELU_MODES
from fusedserve.kernels.triton._pointwise import launch_bias_gelu


def bias_gelu(x: Tensor, bias: Tensor, approximate: str = "none", *, out: Tensor | None = None) -> Tensor:
    check_device("bias_gelu", x, bias)
    if approximate not in GELU_MODES:
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    cols = x.shape[-1]
    x2 = as_rows(x, cols, "bias_gelu")
    y = output_like(x2, x.shape, out, "bias_gelu")
    launch_bias_gelu(x2, as_vector(bias, cols, "bias_gelu bias"), None, y, GELU_MODES[approximate])
    return out if out is not None else y.view(x.shape)
