"""GELU in Triton, shared by every kernel that ends in one (inlined at compile time)."""

import triton
import triton.language as tl

GELU_NONE: tl.constexpr = 0
GELU_ERF: tl.constexpr = 1
GELU_TANH: tl.constexpr = 2

GELU_MODES = {"none": GELU_ERF, "tanh": GELU_TANH}  # the ops' `approximate` argument -> mode


@triton.jit
def fast_erf(x):
    # erf(x) = x * P(x^2) / Q(x^2) on [-4, 4], +-1 beyond (|erf(4)| = 1 - 1.5e-8): a branch-free rational
    # approximation (Eigen's float erf), max abs error 4.2e-7 against math.erf, about a third of the
    # instructions of libdevice erf. The half-precision kernels are instruction-bound on erf otherwise.
    x = tl.minimum(tl.maximum(x, -4.0), 4.0)
    x2 = x * x
    p = x2 * -2.72614225801306e-10 + 2.77068142495902e-08
    p = p * x2 - 2.10102402082508e-06
    p = p * x2 - 5.69250639462346e-05
    p = p * x2 - 7.34990630326855e-04
    p = p * x2 - 2.95459980854025e-03
    p = p * x2 - 1.60960333262415e-02
    q = x2 * -1.45660718464996e-05 - 2.13374055278905e-04
    q = q * x2 - 1.68282697438203e-03
    q = q * x2 - 7.37332916720468e-03
    q = q * x2 - 1.42647390514189e-02
    # exactly +-1 at the clamp, so gelu(-inf) = -inf * 0 = NaN and gelu(inf) = inf, as the reference gives
    return tl.where(x * x >= 16.0, tl.where(x > 0, 1.0, -1.0), x * p / q)


@triton.jit
def gelu(h, MODE: tl.constexpr):
    if MODE == 1:
        # exact: 0.5 * h * (1 + erf(h / sqrt(2))); float64 (gradcheck) keeps libdevice-accurate erf
        if h.dtype == tl.float64:
            h = 0.5 * h * (1.0 + tl.erf(h * 0.7071067811865476))
        else:
            h = 0.5 * h * (1.0 + fast_erf(h * 0.7071067811865476))
    elif MODE == 2:
        # tanh form: 0.5 * h * (1 + tanh(sqrt(2/pi) * (h + 0.044715 h^3))), tanh(z) = 1 - 2 / (exp(2z) + 1)
        z = 0.7978845608028654 * (h + 0.044715 * h * h * h)
        h = 0.5 * h * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))
    return h
