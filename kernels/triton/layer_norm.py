"""Triton LayerNorm: launcher for the shared norm kernel with no residual and no activation."""

from __future__ import annotations

from torch import Tensor

from fusedserve.kernels.triton._common import as_rows, as_vector, check_device, output_like
from fusedserve.kernels.triton._gelu import GELU_NONE
from fusedserve.kernels.triton._norm import launch_norm


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-12, *, out: Tensor | None = None) -> Tensor:
    check_device("layer_norm", x, weight, bias)
    cols = x.shape[-1]
    x2 = as_rows(x, cols, "layer_norm")
    y = output_like(x2, x.shape, out, "layer_norm")
    launch_norm(x2, None, None, as_vector(weight, cols, "layer_norm weight"), as_vector(bias, cols, "layer_norm bias"),
                y, None, eps, GELU_NONE)
    return out if out is not None else y.view(x.shape)
