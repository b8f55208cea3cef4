"""Triton add + RMSNorm: RMSNorm(x + residual) in transformers' Qwen2/Qwen3 order, optionally also storing the pre-norm
sum (a pre-norm decoder's residual stream)."""

from __future__ import annotations

import torch
from torch import Tensor

from fusedserve.kernels.triton._common import as_rows, as_vector, check_device, output_like
from fusedserve.kernels.triton._norm import launch_rms_norm


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6, *, return_sum: bool = False,
                 out: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    check_device("add_rms_norm", x, residual, weight)
    if residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    cols = x.shape[-1]
    x2 = as_rows(x, cols, "add_rms_norm")
    y = output_like(x2, x.shape, out, "add_rms_norm")
    pre_norm_sum = torch.empty_like(x2) if return_sum else None
    launch_rms_norm(x2, as_rows(residual, cols, "add_rms_norm residual"),
                    as_vector(weight, cols, "add_rms_norm weight"), y, pre_norm_sum, eps)
    y = out if out is not None else y.view(x.shape)
    return (y, pre_norm_sum.view(x.shape)) if return_sum else y
