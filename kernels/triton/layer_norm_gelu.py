"""Triton LayerNorm + GELU in one pass over the row."""

from __future__ import annotations

from torch import Tensor

from fusedserve.kernels.triton._common import as_rows, as_vector, check_device, output_like
from fusedserve.kernels.triton._gelu import GELU_MODES
from fusedserve.kernels.triton._norm import launch_norm


def layer_norm_gelu(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-12, approximate: str = "none",
                    *, out: Tensor | None = None) -> Tensor:
    check_device("layer_norm_gelu", x, weight, bias)
    if approximate not in GELU_MODES:
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    cols = x.shape[-1]
    x2 = as_rows(x, cols, "layer_norm_gelu")
    y = output_like(x2, x.shape, out, "layer_norm_gelu")
    launch_norm(x2, None, None, as_vector(weight, cols, "layer_norm_gelu weight"),
                as_vector(bias, cols, "layer_norm_gelu bias"), y, None, eps, GELU_MODES[approximate])
    return out if out is not None else y.view(x.shape)
