"""Triton kernels that hand an FP8 (E4M3) GEMM its input: each row of an activation quantized with its own scale
(amax / 448), written as the op that produces the activation ends, so the fp16 value is not read back.

One program per row: the row's amax is a reduction over the whole row, and an encoder's rows (384-4096 columns)
fit one block. Values are rounded onto the E4M3 grid in fp32 before the cast (_to_e4m3): the cast is then exact on
every path. The GPU's own conversion rounds to nearest even and saturates as well; Triton's interpreter does not
(it rounds 1.0625 up to 1.125, 126.5 to 64 and 500 to 256), and the tests run these kernels on the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusedserve.kernels.triton._common import deferrable
from fusedserve.kernels.triton._gelu import GELU_ERF, gelu

E4M3_MAX = 448.0
# a row of zeros gets this scale (its values quantize to 0 whatever it is); amax below it is clamped up
MIN_AMAX = 1e-12


@triton.jit
def _to_e4m3(v):
    """v (fp32, |v| <= 448 up to rounding) rounded to nearest even on the E4M3 grid, saturating at +-448: three
    mantissa bits in every binade from 2^-6 up, steps of 2^-9 below (the subnormals). Adding 2^(e + 20) to |v| in
    [2^e, 2^(e + 1)) leaves fp32 an ulp of 2^(e - 3), and the add rounds to it."""
    a = tl.abs(v)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    magic = ((e + 147) << 23).to(tl.float32, bitcast=True)
    r = tl.minimum((a + magic) - magic, 448.0)
    return tl.where(v < 0, -r, r)


@triton.jit
def _store_row(q_row, s_ptr, row, v, mask):
    """Row `row`'s values v (fp32) as E4M3 at q_row, its scale at s_ptr[row]."""
    amax = tl.maximum(tl.max(tl.where(mask, tl.abs(v), 0.0), 0), 1e-12)
    # a NaN or Inf in the row makes its scale NaN (the sum of v * 0), so the GEMM's row is NaN too: max and min
    # drop NaN on the GPU, which would otherwise store it as +-448
    scale = amax / 448.0 + tl.sum(tl.where(mask, v * 0.0, 0.0), 0)
    tl.store(q_row, _to_e4m3(v / scale).to(q_row.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


@deferrable
@triton.jit
def _quantize_kernel(X, Q, S, cols, stride_x, stride_q, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < cols
    x = tl.load(X + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    _store_row(Q + row * stride_q + c, S, row, x, mask)


@deferrable
@triton.jit
def _bias_gelu_quantize_kernel(X, BIAS, Q, S, cols, stride_x, stride_q, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < cols
    h = tl.load(X + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    h += tl.load(BIAS + c, mask=mask, other=0.0).to(tl.float32)
    _store_row(Q + row * stride_q + c, S, row, gelu(h, GELU), mask)


@deferrable
@triton.jit
def _add_layer_norm_quantize_kernel(X, R, BIAS, W, B, Y, Q, S, cols, eps, stride_x, stride_r, stride_y, stride_q,
                                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < cols
    v = tl.load(X + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    v += tl.load(R + row * stride_r + c, mask=mask, other=0.0).to(tl.float32)
    v += tl.load(BIAS + c, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(v, 0) / cols
    d = tl.where(mask, v - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(d * d, 0) / cols + eps)
    w = tl.load(W + c, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + c, mask=mask, other=0.0).to(tl.float32)
    y = (d * rstd * w + b).to(Y.dtype.element_ty)
    tl.store(Y + row * stride_y + c, y, mask=mask)
    _store_row(Q + row * stride_q + c, S, row, y.to(tl.float32), mask)  # the value the next residual reads


def _launch_shape(cols: int) -> tuple[int, int]:
    block = triton.next_power_of_2(cols)
    return block, min(16, max(1, block // 256))


def _outputs(x: Tensor) -> tuple[Tensor, Tensor]:
    rows, cols = x.shape
    return (torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x.device),
            torch.empty((rows, 1), dtype=torch.float32, device=x.device))


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    q, s = _outputs(x)
    if x.shape[0]:
        block, warps = _launch_shape(x.shape[1])
        _quantize_kernel[(x.shape[0],)](x, q, s, x.shape[1], x.stride(0), q.stride(0), BLOCK=block,
                                        num_warps=warps)
    return q, s


def bias_gelu_quantize(x: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    q, s = _outputs(x)
    if x.shape[0]:
        block, warps = _launch_shape(x.shape[1])
        _bias_gelu_quantize_kernel[(x.shape[0],)](x, bias, q, s, x.shape[1], x.stride(0), q.stride(0), GELU=GELU_ERF,
                                                  BLOCK=block, num_warps=warps)
    return q, s


def add_layer_norm_quantize(x: Tensor, residual: Tensor, bias: Tensor, weight: Tensor, ln_bias: Tensor,
                            eps: float) -> tuple[Tensor, Tensor, Tensor]:
    q, s = _outputs(x)
    y = torch.empty_like(residual)
    if x.shape[0]:
        block, warps = _launch_shape(x.shape[1])
        _add_layer_norm_quantize_kernel[(x.shape[0],)](
            x, residual, bias, weight, ln_bias, y, q, s, x.shape[1], eps, x.stride(0), residual.stride(0),
            y.stride(0), q.stride(0), BLOCK=block, num_warps=warps)
    return y, q, s
