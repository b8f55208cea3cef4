"""Shared body of the int64-offset test both fused backends run on the GPU."""

from __future__ import annotations

import torch

from kernels.testing import compare, float64_reference


def check_offsets_past_two_to_the_31(launchers, op: str) -> None:
    """2^31 + a few rows' worth of bf16 elements (4.3 GB): the kernel must address the tail correctly."""
    cols = 1024
    rows = 2**31 // cols + 3
    gen = torch.Generator(device="cuda").manual_seed(9)
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, generator=gen)
    bias = torch.randn(cols, device="cuda", dtype=torch.bfloat16, generator=gen)
    if op == "bias_gelu":
        out = launchers[op](x, bias)
        tail_args = (x[-5:], bias)
    else:
        residual = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.ones(cols, device="cuda", dtype=torch.bfloat16)
        b = torch.zeros(cols, device="cuda", dtype=torch.bfloat16)
        out = launchers[op](x, residual, bias, w, b, 1e-5)
        tail_args = (x[-5:], residual[-5:], bias, w, b, 1e-5)
        del residual
    tail = out[-5:].clone()
    del out, x
    assert compare(tail, float64_reference(op, tail_args, {}), torch.bfloat16).ok
