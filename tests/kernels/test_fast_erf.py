"""The bound on the Triton kernels' fast erf (kernels/triton/_gelu.py), measured against float64 erf over every
input that matters: every finite fp16 and bf16 value (what a half-precision activation can be before the scale by
1/sqrt(2)), a dense grid over [-6, 6] (past the clamp at +-4 too) and fp32 values log-spaced out to the largest
finite one. On this machine's device: the Triton interpreter here, the GPU there (where the same jitted function
is inlined into every GELU kernel)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from kernels.triton._gelu import fast_erf, gelu

# the bound the kernels' GELU rests on: 4.2e-7 for the rational approximation itself, plus fp32 rounding of its
# evaluation; far inside the kernel tolerance table's fp32 entries (GELU = 0.5 h (1 + erf): the error in h is
# 0.5 |h| times this)
ERF_MAX_ABS = 6e-7


@triton.jit
def _erf_kernel(X, Y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(Y + offs, fast_erf(tl.load(X + offs, mask=mask, other=0.0)), mask=mask)


def _fast_erf(x: torch.Tensor) -> torch.Tensor:
    y = torch.full_like(x, float("nan"))  # poisoned: an unwritten element fails
    block = 1 << 16
    _erf_kernel[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), BLOCK=block)
    return y


def _all_finite(dtype: torch.dtype) -> torch.Tensor:
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    return bits[torch.isfinite(bits)].float() * (1 / math.sqrt(2))  # as gelu scales its input


def _inputs() -> dict[str, torch.Tensor]:
    big = torch.logspace(-30, math.log10(torch.finfo(torch.float32).max), 20_000, dtype=torch.float64).float()
    return {"every fp16": _all_finite(torch.float16), "every bf16": _all_finite(torch.bfloat16),
            "grid [-6, 6]": torch.linspace(-6, 6, 1_000_001), "log-spaced fp32": torch.cat([big, -big])}


@pytest.mark.parametrize("name", list(_inputs()))
def test_fast_erf_is_within_its_bound_against_float64(name, device):
    x = _inputs()[name]
    got = _fast_erf(x.to(device)).double().cpu().numpy()
    want = np.vectorize(math.erf)(x.double().numpy())
    assert np.isfinite(got).all(), "fast_erf gave a NaN or an infinity on a finite input"
    err = np.abs(got - want)
    worst = int(err.argmax())
    assert err.max() <= ERF_MAX_ABS, f"{name}: |error| {err.max():.3g} at x = {x[worst].item()!r}"


@triton.jit
def _gelu_kernel(X, Y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(Y + offs, gelu(tl.load(X + offs, mask=mask, other=0.0), 1), mask=mask)


def test_the_exact_gelu_on_it_keeps_nan_and_the_infinities_as_the_reference(device):
    """fast_erf clamps (so erf(NaN) may come out as -1, as the GPU's fmax drops a NaN); the GELU built on it still
    gives the reference's NaN for NaN and -inf and inf for inf."""
    x = torch.tensor([float("nan"), float("-inf"), float("inf"), -3.0, 0.5], device=device)
    y = torch.full_like(x, 123.0)
    _gelu_kernel[(1,)](x, y, x.numel(), BLOCK=8)
    x, y = x.cpu(), y.cpu()
    want = torch.nn.functional.gelu(x.double())
    assert torch.isnan(y[0]) and torch.isnan(want[0]) and torch.isnan(y[1]) and torch.isnan(want[1])
    assert y[2] == want[2] == float("inf")
    torch.testing.assert_close(y[3:].double(), want[3:], rtol=0, atol=1e-6)
