"""What the flash-attention kernels over a packed qkv [T, 3H] share (relative_attention.py, rotary_attention.py): the
online-softmax step, the zeros of the rows outside the sequences, the launch-shape rule, the launchers' checks, and
the limits past which a launch hands over to the torch reference (MAX_HEAD_DIM, MAX_SEQUENCES).

Layout: qkv.view(T, 3, heads, d), one program per (query block, sequence, head) and one more grid row of programs
(the last) for the rows outside [cu_seqlens[0], cu_seqlens[-1]) (a graph bucket's filler tokens).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusedserve.kernels._layout import offsets
from fusedserve.kernels.triton._common import INTERPRET, check_device

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 128  # one head's [BLOCK_M, head_dim] q and accumulator stay in registers; wider: torch
MAX_SEQUENCES = 65535 - 1  # grid axis 1 is sequences + the filler row, and CUDA caps it at 65535
LOG2E = 1.4426950408889634


@triton.jit
def online_softmax(s, v, m, total, acc, dtype, IEEE: tl.constexpr):
    """One key block of online softmax: the running max m, sum `total` and accumulator acc [BLOCK_M, BLOCK_D] after
    the scores s [BLOCK_M, BLOCK_N] (log2 units; keys left out at -inf) and the values v [BLOCK_N, BLOCK_D]. p goes
    into the p v product rounded once to the input dtype (IEEE: fp32 products, p unrounded)."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    # a row that has met no key yet (every score so far -inf: a key block outside its window) shifts by 0, so its p
    # and alpha are 0 instead of NaN; a row with a key shifts by its max as usual
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - shift[:, None])
    alpha = tl.exp2(m - shift)
    total = total * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = tl.dot(p, v.to(tl.float32), acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(dtype), v, acc * alpha[:, None])
    return m_new, total, acc


@triton.jit
def sequence_rows(cu_ptr, seq, T):
    """Sequence `seq`'s rows [start, end) of the packed batch, clamped into [0, T] (a graph bucket's filler offsets
    may point past the batch's rows: they read and write nothing)."""
    start = tl.minimum(tl.maximum(tl.load(cu_ptr + seq).to(tl.int32), 0), T)
    end = tl.minimum(tl.maximum(tl.load(cu_ptr + seq + 1).to(tl.int32), start), T)
    return start, end


@triton.jit
def load_block(ptr, rows, end, stride, col, dims, d_ok, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """A block of rows' HEAD_DIM columns from column `col` on ([rows, BLOCK_D]): zeros for rows past `end` and
    columns past the head's width."""
    mask = rows[:, None] < end
    if BLOCK_D != HEAD_DIM:
        mask = mask & d_ok[None, :]
    return tl.load(ptr + rows[:, None].to(tl.int64) * stride + (col + dims)[None, :], mask=mask, other=0.0)


@triton.jit
def zero_outside(y_ptr, cu_ptr, T, stride_y, head, part, parts, sequences,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The filler grid row's work: zeros into rows [0, cu[0]) and [cu[B], T) of this head's columns, spread over the
    query-block programs (part of parts)."""
    dims = tl.arange(0, BLOCK_D)
    y_cols = head * HEAD_DIM + dims
    d_ok = dims < HEAD_DIM
    first_real = tl.minimum(tl.maximum(tl.load(cu_ptr).to(tl.int32), 0), T)
    end_real = tl.minimum(tl.maximum(tl.load(cu_ptr + sequences).to(tl.int32), first_real), T)
    zeros = tl.zeros((BLOCK_M, BLOCK_D), dtype=y_ptr.dtype.element_ty)
    for first in range(part * BLOCK_M, first_real, BLOCK_M * parts):
        rows = first + tl.arange(0, BLOCK_M)
        tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + y_cols[None, :], zeros,
                 mask=(rows[:, None] < first_real) & d_ok[None, :])
    for first in range(end_real + part * BLOCK_M, T, BLOCK_M * parts):
        rows = first + tl.arange(0, BLOCK_M)
        tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + y_cols[None, :], zeros,
                 mask=(rows[:, None] < T) & d_ok[None, :])


def launch_shape(max_seqlen: int, head_dim: int, ieee: bool = False) -> dict:
    """Rules, not autotuning (the registry races backends at start-up; a graph bucket's max_seqlen picks one shape).
    Register pressure decides most of it: a tile's score and probability blocks (and the op's own: relative_attention's
    bias tile) live beside the accumulator. Both kernels walk a
    sequence's key blocks in one loop with every block masked: a loop of unmasked whole blocks with the partial block
    after it inlines the block's body twice, and the sm_90 compile of that spilled at head_dim 64 on the 64 x 64
    tiles below (ptxas -v), where the one loop does not. In fp16/bf16 at head widths 32 and 64 no shape below spills
    in either kernel, nor in fp32 at 32; heads of 128 and fp32 at 64 spill a little in some shapes, and odd widths
    padded to a power of two may spill more.
    - Sequences of at most 64 tokens (a single request, small buckets): square blocks of the bound rounded up to a
      power of two (at least 16, tl.dot's least), no lanes spent on padding.
    - Longer ones: 64 keys a step (K and V tiles of 64 x head_dim) and 64 queries a program on 4 warps (one Hopper
      warp group); from 256 tokens on, 128 queries on 8 warps, where fewer query blocks re-read the sequence's keys
      and the grid still fills the GPU. Heads wider than 64 take 8 warps from 64 queries on.
    - Two stages of K/V loads in flight (three for the long sequences' longer key loops at head_dim <= 64): a third
      stage costs registers where the key loop is only a few blocks long.
    - fp32 (IEEE products, on the FMA units with their operands in registers): 32 x 32 blocks at most, on 8 warps."""
    block_d = max(triton.next_power_of_2(head_dim), 16)
    square = max(triton.next_power_of_2(max(max_seqlen, 1)), 16)
    if ieee:
        block = min(square, 32)
        return {"BLOCK_M": block, "BLOCK_N": block, "BLOCK_D": block_d, "num_warps": 8 if block >= 32 else 4,
                "num_stages": 2}
    if max_seqlen <= 64:
        block_m = block_n = square
    else:
        block_m, block_n = (128 if max_seqlen >= 256 else 64), 64
    warps = 8 if block_m >= 128 or (block_d > 64 and block_m >= 64) else 4
    stages = 3 if block_m >= 128 and block_d <= 64 else 2
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": block_d, "num_warps": warps, "num_stages": stages}


def ieee_products(dtype: torch.dtype) -> bool:
    """fp32 inputs take IEEE fp32 products; so does bf16 on the interpreter, whose bf16 dot is wrong (its fp32 -> bf16
    conversion truncates): there bf16 runs the fp32 path, the GPU runs its own."""
    return dtype == torch.float32 or (INTERPRET and dtype == torch.bfloat16)


def grid(max_seqlen: int, block_m: int, cu_seqlens: Tensor, num_heads: int) -> tuple[int, int, int]:
    """(query blocks of the bound, sequences + the filler row, heads)."""
    return triton.cdiv(max(max_seqlen, 1), block_m), cu_seqlens.numel(), num_heads


def check_packed(name: str, qkv: Tensor, cu_seqlens: Tensor, num_heads: int, out: Tensor | None,
                 *others: Tensor, num_kv_heads: int | None = None) -> Tensor:
    """The checks every packed-attention launcher makes (qkv [T, 3H] in a kernel dtype, heads that split H, `out` a
    contiguous [T, H] of qkv's dtype, `others` on qkv's device); returns the checked offsets (contiguous, on qkv's
    device). With num_kv_heads (grouped-query attention): qkv [T, (heads + 2 kv_heads) d], kv_heads dividing heads,
    the output [T, heads d]."""
    check_device(name, qkv, *others)
    if qkv.dtype not in DTYPES:
        raise TypeError(f"{name}: qkv must be one of {DTYPES}, got {qkv.dtype}")
    if num_kv_heads is None or num_kv_heads == num_heads:
        if qkv.dim() != 2 or qkv.shape[1] % 3:
            raise ValueError(f"{name}: qkv must be [T, 3H] (query, key and value stacked), got {tuple(qkv.shape)}")
        hidden = qkv.shape[1] // 3
        if num_heads < 1 or hidden % num_heads:
            raise ValueError(f"{name}: {num_heads} heads do not split {hidden} columns")
    else:
        if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"{name}: {num_kv_heads} key/value heads do not divide {num_heads} query heads")
        stacked = num_heads + 2 * num_kv_heads
        if qkv.dim() != 2 or qkv.shape[1] % stacked:
            raise ValueError(f"{name}: qkv must be [T, (heads + 2 kv_heads) d] = [T, {stacked} d] (query, key and "
                             f"value heads stacked), got {tuple(qkv.shape)}")
        hidden = qkv.shape[1] // stacked * num_heads
    shape = (qkv.shape[0], hidden)
    if out is not None and (out.shape != shape or out.dtype != qkv.dtype or not out.is_contiguous()):
        raise ValueError(f"{name}: out must be a contiguous {qkv.dtype} tensor of shape {shape}")
    return offsets(name, qkv, cu_seqlens)
