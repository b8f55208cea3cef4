"""Triton add + RMSNorm: RMSNorm(x + residual) in transformers' Qwen2/Qwen3 order, optionally also storing the pre-norm
sum (a pre-norm decoder's residual stream)."""

from __future__ import annotations

from torch import Tensor

from fusedserve.kernels.triton._common import as_vector, check_device
from fusedserve.kernels.triton._norm import add_and_norm, launch_rms_norm


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6, *, return_sum: bool = False,
                 out: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    check_device("add_rms_norm", x, residual, weight)
    weight = as_vector(weight, x.shape[-1], "add_rms_norm weight")
    return add_and_norm("add_rms_norm", x, residual, out, return_sum,
                        lambda x2, r2, y, s: launch_rms_norm(x2, r2, weight, y, s, eps))
