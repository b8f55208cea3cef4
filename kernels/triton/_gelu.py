"""GELU in Triton, shared by every kernel that ends in one (inlined at compile time)."""

import triton
import triton.language as tl

GELU_NONE: tl.constexpr = 0
GELU_ERF: tl.constexpr = 1
GELU_TANH: tl.constexpr = 2

GELU_MODES = {"none": GELU_ERF, "tanh": GELU_TANH}  # the ops' `approximate` argument -> mode


@triton.jit
def gelu(h, MODE: tl.constexpr):
    if MODE == 1:
        # exact: 0.5 * h * (1 + erf(h / sqrt(2)))
        h = 0.5 * h * (1.0 + tl.erf(h * 0.7071067811865476))
    elif MODE == 2:
        # tanh form: 0.5 * h * (1 + tanh(sqrt(2/pi) * (h + 0.044715 h^3))), tanh(z) = 1 - 2 / (exp(2z) + 1)
        z = 0.7978845608028654 * (h + 0.044715 * h * h * h)
        h = 0.5 * h * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))
    return h
