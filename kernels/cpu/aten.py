"""A BERT layer's GEMM blocks on the CPU with their epilogues folded into as few passes over memory as ATen allows.

Why: the reference is written for exactness on every device (each step a separate tensor, fp16/bf16 widened to fp32
between steps), which on a CPU costs more than the GEMM it follows. Its FFN-in wrote the GEMM's output, then
scaled, erf'ed, added and multiplied it in four more passes over [tokens, 4 x hidden]; here the bias rides in the
GEMM (addmm's C operand) and the exact GELU is ATen's one vectorized in-place pass. The FFN-out and attention-out
blocks start from residual + bias and let the GEMM accumulate into it (beta = 1), then LayerNorm once.

Precision: fp32 as the reference up to summation order. In bf16 the GEMM rounds its output, bias and residual
included, to bf16 before GELU or LayerNorm (the reference adds them in fp32); ATen's GELU and LayerNorm still compute
in fp32 inside. fp16 (10 mantissa bits, a tighter tolerance) sums the FFN-out block in fp32. The registry's self-test holds both to the kernel tolerance table.
ATen's CPU GELU answers NaN for an infinite input where the reference answers +inf or -0; a row that reached
infinity is NaN after the next LayerNorm either way, so the served result does not change.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check(x: Tensor) -> None:
    if x.device.type != "cpu":
        raise ValueError(f"the CPU backend runs on CPU tensors, got {x.device}")


def _store(y: Tensor, out: Tensor | None) -> Tensor:
    if out is None:
        return y
    out.copy_(y)
    return out


def linear_bias_gelu(x: Tensor, weight: Tensor, bias: Tensor, approximate: str = "none", *,
                     out: Tensor | None = None) -> Tensor:
    """GELU(x @ weight^T + bias): x [..., K], weight [N, K], bias [N] -> [..., N] in x's dtype."""
    _check(x)
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.addmm(bias.to(x.dtype), x2, weight.t())
    torch._C._nn.gelu_(y, approximate=approximate)
    return _store(y.view(*x.shape[:-1], weight.shape[0]), out)


def linear_add_layer_norm(x: Tensor, weight: Tensor, bias: Tensor, residual: Tensor, ln_weight: Tensor,
                          ln_bias: Tensor, eps: float = 1e-12, *, out: Tensor | None = None) -> Tensor:
    """LayerNorm(x @ weight^T + bias + residual): x [..., K], weight [N, K], residual [..., N] -> [..., N]."""
    _check(x)
    n = weight.shape[0]
    x2 = x.reshape(-1, x.shape[-1])
    if x.dtype == torch.float16:
        # fp16's sum rounded before LayerNorm misses the kernel tolerance (bf16's keeps to its wider one): sum in fp32
        s = residual.reshape(-1, n).float().add_(bias.float()).add_(torch.nn.functional.linear(x2, weight))
    else:
        s = torch.add(residual.reshape(-1, n), bias.to(x.dtype))  # a fresh tensor: the GEMM accumulates into it
        s.addmm_(x2, weight.t())
    y = torch.nn.functional.layer_norm(s, (n,), ln_weight.to(s.dtype), ln_bias.to(s.dtype), eps).to(x.dtype)
    return _store(y.view(*x.shape[:-1], n), out)
