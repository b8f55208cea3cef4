"""GELU in Triton, shared by every kernel that ends in one (inlined at compile time)."""

import triton
import triton.language as tl

from fusedserve.kernels.triton._common import INTERPRET

GELU_NONE: tl.constexpr = 0
GELU_ERF: tl.constexpr = 1
GELU_TANH: tl.constexpr = 2

GELU_MODES = {"none": GELU_ERF, "tanh": GELU_TANH}  # the ops' `approximate` argument -> mode

# Abramowitz & Stegun 7.1.26: erfc(x) = t (a1 + t (a2 + t (a3 + t (a4 + t a5)))) exp(-x^2), t = 1 / (1 + p x), x >= 0,
# |error| <= 1.5e-7. The coefficients here carry the 1/2 of Phi = erfc / 2, and p the 1/sqrt(2) of x = |h| / sqrt(2).
_P = tl.constexpr(0.2316418882663604)  # 0.3275911 / sqrt(2)
_A1 = tl.constexpr(0.127414796)
_A2 = tl.constexpr(-0.142248368)
_A3 = tl.constexpr(0.7107068705)
_A4 = tl.constexpr(-0.7265760135)
_A5 = tl.constexpr(0.5307027145)
# Abramowitz & Stegun 7.1.25, the same form with three terms: |error| <= 2.5e-5. For outputs rounded to fp16 or bf16:
# the GELU's error stays under |h| x 1.3e-5. For h >= 0 (result >= h / 2) that is under a twentieth of an fp16 ulp of
# the result. For h < 0 it is an absolute error on small results: up to about ten fp16 ulps for h around -4, and 1-5%
# relative below that (results under 1e-4, where bf16 keeps more digits than the formula); everywhere far inside the
# tolerance table's half-precision entries. The two FMAs fewer per element count in the issue-bound half-precision
# LayerNorm + GELU.
_P3 = tl.constexpr(0.33267452944520627)  # 0.47047 / sqrt(2)
_B1 = tl.constexpr(0.1740121)
_B2 = tl.constexpr(-0.0479399)
_B3 = tl.constexpr(0.3739278)
_HALF_LOG2E = tl.constexpr(-0.7213475204444817)  # exp(-h^2 / 2) = exp2(h^2 * this)
_HARDWARE_RCP = tl.constexpr(not INTERPRET)


@triton.jit
def _reciprocal(x):
    """1 / x for x >= 1 (or inf): the hardware's approximate reciprocal alone (rcp.approx.ftz, one MUFU.RCP, 1 ulp).
    Triton's fp32 `1.0 / x` is div.full.f32, whose range fix-ups around the MUFU.RCP cost six more instructions
    per element, for operands this never has."""
    if _HARDWARE_RCP:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return 1.0 / x


@triton.jit
def normal_cdf(h, HALF: tl.constexpr = False):
    """Phi(h) = (1 + erf(h / sqrt(2))) / 2 in fp32, within 4e-7 of float64, or with HALF (for a result rounded to
    fp16 or bf16) within 1.3e-5 (tests/kernels/test_normal_cdf.py). Computed from erfc of |h|: one approximate
    reciprocal, five (HALF: three) FMAs and one exp2, no branch, about half the instructions of a clamped rational
    erf; the half-precision GELU kernels are issue-bound on this. The negative tail is erfc itself rather than
    1 + erf, so it does not cancel to 0; its error is absolute (the formula's relative error there grows to about 2%
    at h = -10, where Phi is 8e-24)."""
    if HALF:
        t = _reciprocal(1.0 + _P3 * tl.abs(h))
        q = ((_B3 * t + _B2) * t + _B1) * t * tl.exp2(h * h * _HALF_LOG2E)
    else:
        t = _reciprocal(1.0 + _P * tl.abs(h))
        q = ((((_A5 * t + _A4) * t + _A3) * t + _A2) * t + _A1) * t * tl.exp2(h * h * _HALF_LOG2E)
    return tl.where(h >= 0, 1.0 - q, q)


@triton.jit
def gelu(h, MODE: tl.constexpr, HALF: tl.constexpr = False):
    """GELU of fp32 (or fp64) h; HALF: the result is rounded to fp16 or bf16 next, and the exact form may use the
    shorter normal CDF (normal_cdf)."""
    if MODE == 1:
        # exact: h * Phi(h); float64 (gradcheck) keeps libdevice-accurate erf
        if h.dtype == tl.float64:
            h = 0.5 * h * (1.0 + tl.erf(h * 0.7071067811865476))
        else:
            # h * (1 - q) and not h - h * q: at h = inf, q = 0 and inf * 0 would be NaN. At h = -inf the product is
            # -inf * 0 = NaN, as the reference gives
            h = h * normal_cdf(h, HALF)
    elif MODE == 2:
        # tanh form: 0.5 * h * (1 + tanh(sqrt(2/pi) * (h + 0.044715 h^3))), tanh(z) = 1 - 2 / (exp(2z) + 1)
        z = 0.7978845608028654 * (h + 0.044715 * h * h * h)
        h = 0.5 * h * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))
    return h
