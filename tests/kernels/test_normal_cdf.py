"""The bound on the Triton kernels' normal CDF (kernels/triton/_gelu.py, the exact GELU is h * Phi(h)), measured
against float64 over every input that matters: every finite fp16 and bf16 value (what a half-precision activation can
be), a dense grid over [-12, 12] (where Phi leaves 0 and 1) and fp32 values log-spaced out to the largest finite one.
On this machine's device: the Triton interpreter here, the GPU there (where the same jitted function is inlined into
every GELU kernel, with the hardware's approximate reciprocal and exp2)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from fusedserve.kernels.triton._gelu import gelu, normal_cdf

# The bounds the kernels' GELU rests on (its error is |h| times this), by whether the result is rounded to a half type
# next. fp32: 1.5e-7 / 2 for Abramowitz & Stegun's five-term erfc itself, plus fp32 rounding of its evaluation
# (1 - q near Phi = 1/2) and the approximate reciprocal and exp2; far inside the kernel tolerance table's fp32 entries.
# Half: 2.5e-5 / 2 for the three-term erfc, plus the same rounding; a tenth of an fp16 ulp at 1 and far inside the
# table's fp16 and bf16 entries.
PHI_MAX_ABS = {False: 4e-7, True: 1.3e-5}


@triton.jit
def _cdf_kernel(X, Y, N, HALF: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(Y + offs, normal_cdf(tl.load(X + offs, mask=mask, other=0.0), HALF), mask=mask)


def _normal_cdf(x: torch.Tensor, half: bool) -> torch.Tensor:
    y = torch.full_like(x, float("nan"))  # poisoned: an unwritten element fails
    block = 1 << 16
    _cdf_kernel[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), HALF=half, BLOCK=block)
    return y


def _all_finite(dtype: torch.dtype) -> torch.Tensor:
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    return bits[torch.isfinite(bits)].float()


def _inputs() -> dict[str, torch.Tensor]:
    big = torch.logspace(-30, math.log10(torch.finfo(torch.float32).max), 20_000, dtype=torch.float64).float()
    return {"every fp16": _all_finite(torch.float16), "every bf16": _all_finite(torch.bfloat16),
            "grid [-12, 12]": torch.linspace(-12, 12, 1_000_001), "log-spaced fp32": torch.cat([big, -big])}


@pytest.mark.parametrize("half", [False, True], ids=["fp32 result", "half result"])
@pytest.mark.parametrize("name", list(_inputs()))
def test_normal_cdf_is_within_its_bound_against_float64(name, half, device):
    x = _inputs()[name]
    got = _normal_cdf(x.to(device), half).double().cpu().numpy()
    want = np.vectorize(lambda v: 0.5 * math.erfc(-v / math.sqrt(2)))(x.double().numpy())
    assert np.isfinite(got).all(), "normal_cdf gave a NaN or an infinity on a finite input"
    err = np.abs(got - want)
    worst = int(err.argmax())
    assert err.max() <= PHI_MAX_ABS[half], f"{name}: |error| {err.max():.3g} at x = {x[worst].item()!r}"
    if half:  # the short form is what it claims to be: worse than the long one, so not the long one by mistake
        assert err.max() > PHI_MAX_ABS[False], f"{name}: the three-term erfc is as accurate as the five-term one"


@triton.jit
def _gelu_kernel(X, Y, N, HALF: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(Y + offs, gelu(tl.load(X + offs, mask=mask, other=0.0), 1, HALF), mask=mask)


@pytest.mark.parametrize("half", [False, True], ids=["fp32 result", "half result"])
def test_the_exact_gelu_on_it_keeps_nan_and_the_infinities_as_the_reference(half, device):
    """The GELU built on it gives the reference's NaN for NaN and -inf, inf for inf, 0 and the identity far out."""
    x = torch.tensor([float("nan"), float("-inf"), float("inf"), -3.0, 0.5, -1e30, 1e30, 0.0], device=device)
    y = torch.full_like(x, 123.0)
    _gelu_kernel[(1,)](x, y, x.numel(), HALF=half, BLOCK=8)
    x, y = x.cpu(), y.cpu()
    want = torch.nn.functional.gelu(x.double())
    assert torch.isnan(y[0]) and torch.isnan(want[0]) and torch.isnan(y[1]) and torch.isnan(want[1])
    assert y[2] == want[2] == float("inf")
    torch.testing.assert_close(y[3:5].double(), want[3:5], rtol=0, atol=3 * PHI_MAX_ABS[half])
    assert y[5] == 0 and y[6] == 1e30 and y[7] == 0, y[5:]
