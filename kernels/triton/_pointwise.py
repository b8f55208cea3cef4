"""The elementwise kernel behind bias_gelu and bias_residual_gelu: GELU(x + bias [+ residual]) over 2-D
tiles of rows x a column block, so a program loads its bias slice once and finds an element's column without the
per-element integer modulo a flat 1-D kernel needs for odd widths."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusedserve.kernels.triton._common import autotune, block_cols, needs_wide, row_bucket
from fusedserve.kernels.triton._gelu import gelu


def column_block(cols: int) -> int:
    """The column block: the largest power of two (at most 1024) that divides the width when that is at least 64
    (384 -> 128, 768 -> 256, 1536 -> 512: exact blocks, no padding lanes and no column mask), else the width rounded
    up to a power of two, at most 1024 (masked)."""
    exact = min(cols & -cols, 1024)
    return exact if exact >= 64 else min(block_cols(cols), 1024)


def pointwise_configs(block_n: int, element_bytes: int = 4) -> list[tuple[int, int]]:
    """(BLOCK_M, num_warps) candidates, the heuristic first: tiles of 4096 / 2048 / 8192 / 1024 elements, 16 or 32
    elements per thread, and 8, or for 4-byte elements also 4 (one or two 16-byte fp32 vectors, as inductor's flat
    fp32 kernels hold: in fp32 the GELU is cheap beside the bytes, and more threads keep more loads in flight; four
    2-byte elements would be half a vector). One row of 1024 columns per program is the fastest candidate at some
    fp32 shapes."""
    out = []
    for tile in (4096, 2048, 8192, 1024):
        block_m = max(tile // block_n, 1)
        for per_thread in (16, 32, 8, 4) if element_bytes >= 4 else (16, 32, 8):
            warps = min(max(block_m * block_n // (32 * per_thread), 1), 16)
            if (block_m, warps) not in out:
                out.append((block_m, warps))
    return out


def _prune(configs, named_args, **kwargs):
    wanted = pointwise_configs(kwargs["BLOCK_N"], named_args["X"].element_size())
    return [c for w in wanted for c in configs if (c.kwargs["BLOCK_M"], c.num_warps) == w]


_CONFIGS = [
    triton.Config({"BLOCK_M": 2**m}, num_warps=2**w)
    for m in range(14)  # BLOCK_M 1 .. 8192
    for w in range(5)  # 1 .. 16 warps
]


@autotune(_CONFIGS, key=["N", "M_BUCKET", "HAS_RESIDUAL", "GELU"], prune=_prune)
@triton.jit(do_not_specialize=["M", "M_BUCKET"])  # counts: see _common.autotune
def _bias_gelu_kernel(
    X,  # [M, N] input
    BIAS,  # [N] bias
    R,  # [M, N] residual (unused unless HAS_RESIDUAL)
    Y,  # [M, N] output
    stride_x, stride_r, stride_y,  # row strides; columns are unit-stride
    M, N,
    M_BUCKET,  # autotune key only
    HAS_RESIDUAL: tl.constexpr,
    GELU: tl.constexpr,
    F64: tl.constexpr,
    WIDE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # column_block(N)
    EVEN_N: tl.constexpr,  # BLOCK_N divides N: no column mask
    BLOCK_M: tl.constexpr,
):
    # one flat grid, the column blocks of a row tile side by side: programs launched together read one contiguous
    # stretch of memory, where a 2-D grid with the row tiles fastest has them read a column block of many rows each,
    # strided
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(N, BLOCK_N)
    row_block = pid // col_blocks
    if WIDE:  # offsets past 2^31 elements need 64-bit arithmetic; otherwise 32-bit is cheaper per element
        row_block = row_block.to(tl.int64)
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if EVEN_N:
        mask = (rows < M)[:, None]  # broadcast along the columns: the accesses stay 16-byte vectors
    else:
        mask = (rows < M)[:, None] & col_ok[None, :]

    # h = x + bias [+ residual]; y = gelu(h)
    h = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    h = h.to(tl.float64) if F64 else h.to(tl.float32)
    h += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(h.dtype)[None, :]
    if HAS_RESIDUAL:
        h += tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(h.dtype)
    y = gelu(h, GELU, Y.dtype.element_ty.primitive_bitwidth == 16)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def launch_bias_gelu(x: Tensor, bias: Tensor, residual: Tensor | None, y: Tensor, gelu_mode: int) -> None:
    rows, cols = x.shape
    if rows == 0:
        return
    block_n = column_block(cols)

    def grid(meta):
        return (triton.cdiv(rows, meta["BLOCK_M"]) * triton.cdiv(cols, meta["BLOCK_N"]),)

    _bias_gelu_kernel[grid](
        x, bias, residual if residual is not None else x, y,
        x.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0),
        rows, cols, row_bucket(rows),
        HAS_RESIDUAL=residual is not None, GELU=gelu_mode, F64=x.dtype == torch.float64,
        WIDE=needs_wide(x, residual, y), BLOCK_N=block_n, EVEN_N=cols % block_n == 0,
    )
