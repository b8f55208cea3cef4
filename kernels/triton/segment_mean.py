"""Mean of each segment of rows in one kernel: the mean pooling of a packed batch.

Why: pooling a packed batch in torch takes four or five kernels (a zeroed [batch + 1, hidden] fp32 buffer, the
fp32 copy of the hidden states, index_add_, the division): a visible share of a small model's forward in the profile
(docs/performance.md), and five kernel boundaries of a single request's forward. Here one program per
(segment, column block) walks its segment's rows, sums them in fp32 and divides once.

Rows past the last offset (a CUDA-graph bucket's filler tokens) are never read; an empty segment (a filler
sequence) gives zeros; offsets are clamped to [0, T] so a bad offset cannot read out of bounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusedserve.kernels._layout import segment_arguments
from fusedserve.kernels.triton._common import check_device, deferrable, pdl_args, pdl_sync

@deferrable
@triton.jit(do_not_specialize=["T"])  # counts: see _common.autotune
def _segment_mean_kernel(x_ptr, cu_ptr, y_ptr, T, H, stride_x, stride_y,
                         BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, OUT_F64: tl.constexpr,
                         USE_PDL: tl.constexpr = False):
    seg = tl.program_id(0)
    pdl_sync(USE_PDL)  # the offsets too may be written by an earlier kernel
    start = tl.load(cu_ptr + seg).to(tl.int64)
    end = tl.load(cu_ptr + seg + 1).to(tl.int64)
    start = tl.minimum(tl.maximum(start, 0), T)
    end = tl.minimum(tl.maximum(end, start), T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float64 if OUT_F64 else tl.float32)
    for first in range(start, end, BLOCK_T):
        rows = first + tl.arange(0, BLOCK_T)
        mask = (rows[:, None] < end) & (cols[None, :] < H)
        acc += tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(acc.dtype)
    count = tl.maximum(end - start, 1).to(acc.dtype)
    tl.store(y_ptr + seg.to(tl.int64) * stride_y + cols, tl.sum(acc, axis=0) / count, mask=cols < H)


def segment_mean(x: Tensor, cu_seqlens: Tensor, *, out: Tensor | None = None) -> Tensor:
    """out[b] = mean(x[cu_seqlens[b] : cu_seqlens[b + 1]]) for x [T, H] (unit column stride, any row stride) and
    cu_seqlens [B + 1] int32/int64 on x's device -> [B, H] float32 (float64 for float64 x); `out` (contiguous
    [B, H] of that dtype) is written in place."""
    check_device("segment_mean", x)
    out_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    x, cu_seqlens, y = segment_arguments("segment_mean", x, cu_seqlens, out, out_dtype)
    segments, hidden = y.shape
    if y.numel():
        block_h = min(triton.next_power_of_2(hidden), 128)
        _segment_mean_kernel[(segments, triton.cdiv(hidden, block_h))](
            x, cu_seqlens, y, x.shape[0], hidden, x.stride(0), y.stride(0),
            BLOCK_T=32 if block_h >= 64 else 64, BLOCK_H=block_h, OUT_F64=out_dtype == torch.float64, num_warps=4,
            **pdl_args(x))
    return y
