"""The Triton backend's linear_add_layer_norm: LayerNorm(x @ weight^T + bias + residual), a BERT layer's
attention-out and FFN-out blocks, as a cuBLAS GEMM followed by this backend's add_layer_norm kernel (bias and
residual added there). Why not one kernel: docs/decisions/0001-split-gemm-layer-norm.md."""

from __future__ import annotations

import torch
from torch import Tensor

from fusedserve.kernels.triton._common import check_device
from fusedserve.kernels.triton.add_layer_norm import add_layer_norm

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(x: Tensor, weight: Tensor, bias: Tensor, residual: Tensor, ln_weight: Tensor, ln_bias: Tensor,
           out: Tensor | None) -> None:
    name = "linear_add_layer_norm"
    check_device(name, x, weight, bias, residual, ln_weight, ln_bias)
    tensors = (x, weight, bias, residual, ln_weight, ln_bias)
    if x.dtype not in DTYPES or any(t.dtype != x.dtype for t in tensors):
        raise TypeError(f"{name}: all inputs must share one of {DTYPES}, got {', '.join(str(t.dtype) for t in tensors)}")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{name}: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit x @ weight^T")
    n = weight.shape[0]
    shape = (*x.shape[:-1], n)
    if residual.shape != shape:
        raise ValueError(f"{name}: residual {tuple(residual.shape)} must have the output's shape {shape}")
    for label, v in (("bias", bias), ("ln_weight", ln_weight), ("ln_bias", ln_bias)):
        if v.shape != (n,):
            raise ValueError(f"{name}: {label} {tuple(v.shape)} must be ({n},)")
    if out is not None and (out.shape != shape or out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError(f"{name}: out must be a contiguous {x.dtype} tensor of shape {shape}")


def linear_add_layer_norm(x: Tensor, weight: Tensor, bias: Tensor, residual: Tensor, ln_weight: Tensor,
                          ln_bias: Tensor, eps: float = 1e-12, *, out: Tensor | None = None) -> Tensor:
    """LayerNorm(x @ weight^T + bias + residual) over the last dimension: x [..., K], weight [N, K] (nn.Linear's
    layout), bias / ln_weight / ln_bias [N], residual [..., N] -> [..., N] in x's dtype; `out` (contiguous,
    [..., N]) is written in place."""
    _check(x, weight, bias, residual, ln_weight, ln_bias, out)
    # the GEMM on cuBLAS in x's dtype without its bias: the bias joins the residual in the LayerNorm kernel
    h = torch.nn.functional.linear(x, weight)
    return add_layer_norm(h, residual, bias, ln_weight, ln_bias, eps, out=out)
