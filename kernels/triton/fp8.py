"""Triton kernels that hand an FP8 (E4M3) GEMM its input: each row of an activation quantized with its own scale
(amax / 448), written as the op that produces the activation ends, so the fp16 value is not read back.

A program holds whole rows (one or several): each row's amax is a reduction over all of it, and an encoder's rows
(384-4096 columns) fit one block. Values are rounded onto the E4M3 grid in fp32 before the cast (_to_e4m3): the
cast is then exact on every path. The GPU's own conversion rounds to nearest even and saturates as well; Triton's
interpreter does not (it rounds 1.0625 up to 1.125, 126.5 to 64 and 500 to 256), and the tests run these kernels
on the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusedserve.kernels.triton._common import deferrable
from fusedserve.kernels.triton._gelu import GELU_ERF, gelu

# kernels/fp8.py's E4M3_MAX and MIN_AMAX, as the kernels read them: written out, since kernels/fp8.py imports this
# module (tests/kernels/test_fp8.py holds the kernels to the references' E4M3 values)
_E4M3_MAX = tl.constexpr(448.0)
_MIN_AMAX = tl.constexpr(1e-12)


@triton.jit
def _to_e4m3(v):
    """v (fp32, |v| <= 448 up to rounding) rounded to nearest even on the E4M3 grid, saturating at +-448: three
    mantissa bits in every binade from 2^-6 up, steps of 2^-9 below (the subnormals). Adding 2^(e + 20) to |v| in
    [2^e, 2^(e + 1)) leaves fp32 an ulp of 2^(e - 3), and the add rounds to it."""
    a = tl.abs(v)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    magic = ((e + 147) << 23).to(tl.float32, bitcast=True)
    r = tl.minimum((a + magic) - magic, _E4M3_MAX)
    return tl.where(v < 0, -r, r)


@triton.jit
def _store_rows(Q, stride_q, S, rows, c, v, mask, n_rows):
    """Rows `rows` (a block of them) of values v (fp32, [ROWS, BLOCK]) as E4M3 at Q, each row's scale at S[row]."""
    amax = tl.maximum(tl.max(tl.where(mask, tl.abs(v), 0.0), 1), _MIN_AMAX)
    # a NaN or Inf in a row makes its scale NaN (the sum of v * 0), so the GEMM's row is NaN too: max and min drop
    # NaN on the GPU, which would otherwise store it as +-448
    scale = amax / _E4M3_MAX + tl.sum(tl.where(mask, v * 0.0, 0.0), 1)
    q = _to_e4m3(v / scale[:, None]).to(Q.dtype.element_ty)
    tl.store(Q + rows[:, None] * stride_q + c[None, :], q, mask=mask)
    tl.store(S + rows, scale, mask=rows < n_rows)


@triton.jit
def _block(n_rows, cols, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK)
    return rows, c, (rows[:, None] < n_rows) & (c[None, :] < cols)


@deferrable
@triton.jit
def _quantize_kernel(X, Q, S, n_rows, cols, stride_x, stride_q, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows, c, mask = _block(n_rows, cols, ROWS, BLOCK)
    x = tl.load(X + rows[:, None] * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
    _store_rows(Q, stride_q, S, rows, c, x, mask, n_rows)


@deferrable
@triton.jit
def _bias_gelu_quantize_kernel(X, BIAS, Q, S, n_rows, cols, stride_x, stride_q, GELU: tl.constexpr,
                               ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows, c, mask = _block(n_rows, cols, ROWS, BLOCK)
    h = tl.load(X + rows[:, None] * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
    h += tl.load(BIAS + c, mask=c < cols, other=0.0).to(tl.float32)[None, :]
    _store_rows(Q, stride_q, S, rows, c, gelu(h, GELU), mask, n_rows)


@deferrable
@triton.jit
def _add_layer_norm_quantize_kernel(X, R, BIAS, W, B, Y, Q, S, n_rows, cols, eps, stride_x, stride_r, stride_y,
                                    stride_q, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows, c, mask = _block(n_rows, cols, ROWS, BLOCK)
    col_ok = c < cols
    v = tl.load(X + rows[:, None] * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
    v += tl.load(R + rows[:, None] * stride_r + c[None, :], mask=mask, other=0.0).to(tl.float32)
    v += tl.load(BIAS + c, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    mean = tl.sum(v, 1) / cols
    d = tl.where(mask, v - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(d * d, 1) / cols + eps)
    w = tl.load(W + c, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(B + c, mask=col_ok, other=0.0).to(tl.float32)
    y = (d * rstd[:, None] * w[None, :] + b[None, :]).to(Y.dtype.element_ty)
    tl.store(Y + rows[:, None] * stride_y + c[None, :], y, mask=mask)
    _store_rows(Q, stride_q, S, rows, c, y.to(tl.float32), mask, n_rows)  # the value the next residual reads


def launch_config(cols: int) -> tuple[int, int, int]:
    """(BLOCK, ROWS, num_warps) for rows of `cols` columns: a power-of-two block over the row, and about 4,096
    elements a program (several rows of a narrow width), 4 warps each (docs/decisions/0025-fp8-activations.md)."""
    block = triton.next_power_of_2(cols)
    return block, max(1, min(16, 4096 // block)), LAUNCH_WARPS


LAUNCH_WARPS = 4


def _outputs(x: Tensor) -> tuple[Tensor, Tensor]:
    rows, cols = x.shape
    return (torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x.device),
            torch.empty((rows, 1), dtype=torch.float32, device=x.device))


def quantize_rows(x: Tensor, config: tuple[int, int, int] | None = None) -> tuple[Tensor, Tensor]:
    q, s = _outputs(x)
    if x.shape[0]:
        block, rows, warps = config or launch_config(x.shape[1])
        _quantize_kernel[(triton.cdiv(x.shape[0], rows),)](x, q, s, x.shape[0], x.shape[1], x.stride(0), q.stride(0),
                                                            ROWS=rows, BLOCK=block, num_warps=warps)
    return q, s


def bias_gelu_quantize(x: Tensor, bias: Tensor, config: tuple[int, int, int] | None = None) -> tuple[Tensor, Tensor]:
    q, s = _outputs(x)
    if x.shape[0]:
        block, rows, warps = config or launch_config(x.shape[1])
        _bias_gelu_quantize_kernel[(triton.cdiv(x.shape[0], rows),)](
            x, bias, q, s, x.shape[0], x.shape[1], x.stride(0), q.stride(0), GELU=GELU_ERF, ROWS=rows, BLOCK=block,
            num_warps=warps)
    return q, s


def add_layer_norm_quantize(x: Tensor, residual: Tensor, bias: Tensor, weight: Tensor, ln_bias: Tensor,
                            eps: float, config: tuple[int, int, int] | None = None
                            ) -> tuple[Tensor, Tensor, Tensor]:
    q, s = _outputs(x)
    y = torch.empty_like(residual)
    if x.shape[0]:
        block, rows, warps = config or launch_config(x.shape[1])
        _add_layer_norm_quantize_kernel[(triton.cdiv(x.shape[0], rows),)](
            x, residual, bias, weight, ln_bias, y, q, s, x.shape[0], x.shape[1], eps, x.stride(0), residual.stride(0),
            y.stride(0), q.stride(0), ROWS=rows, BLOCK=block, num_warps=warps)
    return y, q, s
