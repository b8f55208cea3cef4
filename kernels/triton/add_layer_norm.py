"""Triton add + LayerNorm: LayerNorm(x + bias + residual), optionally also storing the pre-norm sum; and the same over
the sum of a split GEMM's partial products (partial_add_layer_norm)."""

from __future__ import annotations

import torch
from torch import Tensor

from fusedserve.kernels.triton._common import as_rows, as_vector, check_device
from fusedserve.kernels.triton._gelu import GELU_NONE
from fusedserve.kernels.triton._norm import add_and_norm, launch_norm


def add_layer_norm(x: Tensor, residual: Tensor, bias: Tensor | None, weight: Tensor, ln_bias: Tensor,
                   eps: float = 1e-12, *, return_sum: bool = False,
                   out: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    check_device("add_layer_norm", x, residual, bias, weight, ln_bias)
    cols = x.shape[-1]
    bias = None if bias is None else as_vector(bias, cols, "add_layer_norm bias")
    weight = as_vector(weight, cols, "add_layer_norm weight")
    ln_bias = as_vector(ln_bias, cols, "add_layer_norm ln_bias")
    return add_and_norm("add_layer_norm", x, residual, out, return_sum,
                        lambda x2, r2, y, s: launch_norm(x2, r2, bias, weight, ln_bias, y, s, eps, GELU_NONE))


def partial_add_layer_norm(parts: Tensor, bias: Tensor | None, residual: Tensor, weight: Tensor, ln_bias: Tensor,
                           eps: float = 1e-12, *, out: Tensor | None = None) -> Tensor:
    """LayerNorm(parts.sum(0) + bias + residual): parts [P, T, H] (a split GEMM's partial products, fp32), residual
    [T, H] -> [T, H] in residual's dtype. The partial sums are added in order inside the norm kernel (deterministic)."""
    name = "partial_add_layer_norm"
    check_device(name, parts, residual, bias, weight, ln_bias)
    if parts.dim() != 3 or parts.shape[1:] != residual.shape or residual.dim() != 2 or parts.shape[0] < 1:
        raise ValueError(f"{name}: parts {tuple(parts.shape)} must be [P >= 1, T, H] over residual "
                         f"{tuple(residual.shape)} [T, H]")
    cols = residual.shape[1]
    parts = parts.contiguous()
    r = as_rows(residual, cols, f"{name} residual")
    if out is None:
        y = torch.empty(r.shape, dtype=residual.dtype, device=residual.device)
    elif out.shape != residual.shape or out.dtype != residual.dtype or not out.is_contiguous():
        raise ValueError(f"{name}: out must be contiguous {tuple(residual.shape)} {residual.dtype}")
    else:
        y = out
    launch_norm(parts[0], r, None if bias is None else as_vector(bias, cols, f"{name} bias"),
                as_vector(weight, cols, f"{name} weight"), as_vector(ln_bias, cols, f"{name} ln_bias"),
                y, None, eps, GELU_NONE, parts=parts)
    return y
