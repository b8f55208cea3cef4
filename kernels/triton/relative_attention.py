"""Self-attention over each packed sequence with a relative position bias (MPNet's), flash-attention style.

Why: MPNet adds B[h, j - i] to every head's scores, a bias that depends only on the head and the distance between
key j and query i. Unfused, that is a [batch, heads, seq, seq] bias added to padded scores (transformers' way): varlen
flash attention takes no bias. Here the bias comes from the [heads, 2R - 1] table of biases by distance: within a
[BLOCK_M, BLOCK_N] tile of scores the distance is constant along each diagonal (a Toeplitz tile), so a tile needs
BLOCK_M + BLOCK_N - 1 consecutive entries of its head's row of the table. The program loads that strip and spreads
it over the tile with tl.gather; the table (a few KB a head) stays in L1 and L2. No [heads, T, T] bias is ever built.

Per program (query block, sequence b, head h): q = the block's rows of the head's query columns, then over the key
blocks of the same sequence: s = q k^T / sqrt(d) + B[h, j - i] in log2 units, online softmax (running max and sum
in fp32, exp2; _packed_attention.online_softmax), acc += p v. The key blocks run in one loop, each masked by the
sequence's end (_packed_attention.launch_shape says why one loop); the program's query rows past the sequence's end
are computed (from clamped positions) and not stored. Products run on tensor cores in fp16/bf16 with fp32
accumulation, and in IEEE fp32 for fp32 inputs (as qkv_attention's _dot). p goes into the p v product rounded once to
the input dtype (flash attention's habit): q, k and v are the op's inputs here, already rounded, so rounding p is the
only error past the reference's fp32 and it stays well inside the fp16 entry of the tolerance table (qkv_attention
splits p into two halves because its own rounding of the projected q, k and v already spends part of that budget).

The last grid row writes zeros into the rows outside [cu_seqlens[0], cu_seqlens[-1]) (a graph bucket's filler
tokens), so the output is fully defined.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusedserve.kernels import reference
from fusedserve.kernels.triton._common import deferrable, pdl_args, pdl_sync
# launch_shape and MAX_HEAD_DIM are this op's too (the tests and the sm_90 compile check read them here)
from fusedserve.kernels.triton._packed_attention import (LOG2E, MAX_HEAD_DIM, MAX_SEQUENCES, check_packed, grid,
                                                         load_block, ieee_products, launch_shape, online_softmax,
                                                         zero_outside, sequence_rows)


@triton.jit
def _attend(q, qkv_ptr, k_col, v_col, bias_row, key, first, end, last, m, total, acc, qk_scale, stride_qkv, dtype,
            HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    """One key block of online-softmax attention: the running max m, sum `total` and accumulator acc after the keys
    key .. key + BLOCK_N (those at or past `end` left out) for the queries first .. first + BLOCK_M."""
    BLOCK_M: tl.constexpr = q.shape[0]
    keys = key + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    rows = keys[:, None].to(tl.int64) * stride_qkv
    kv_mask = keys[:, None] < end
    if BLOCK_D != HEAD_DIM:
        kv_mask = kv_mask & (dims[None, :] < HEAD_DIM)
    k = tl.load(qkv_ptr + rows + (k_col + dims)[None, :], mask=kv_mask, other=0.0)
    v = tl.load(qkv_ptr + rows + (v_col + dims)[None, :], mask=kv_mask, other=0.0)
    # The tile's bias B[h, j - i]: its distances (key + j) - (first + i) run from key - first - (BLOCK_M - 1) to
    # key - first + BLOCK_N - 1, one strip of the table loaded at once (in log2 units) and spread over the tile by
    # position j - i + BLOCK_M - 1 in the strip: a gather from registers and shared memory, where gathering the tile
    # from global memory took a 64-bit address per element (more registers, more instructions, a deeper pipeline).
    # Distances clamp to +-last (the sequence's last position, at most R - 1): only the tile's padding (keys masked
    # out below, query rows never stored) and a sequence longer than the table's reach read a clamped one.
    STRIP: tl.constexpr = 2 * BLOCK_N if BLOCK_N >= BLOCK_M else 2 * BLOCK_M  # BLOCK_M + BLOCK_N - 1, rounded up
    distances = tl.minimum(tl.maximum(tl.arange(0, STRIP) + (key - first - (BLOCK_M - 1)), -last), last)
    strip = tl.load(bias_row + distances).to(tl.float32) * 1.4426950408889634
    tile = tl.arange(0, BLOCK_M * BLOCK_N)
    bias = tl.reshape(tl.gather(strip, tile % BLOCK_N - tile // BLOCK_N + (BLOCK_M - 1), 0), (BLOCK_M, BLOCK_N))
    # s = (q k^T / sqrt(d) + B) * log2(e): softmax by exp2
    if IEEE:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(keys[None, :] < end, s * qk_scale + bias, float("-inf"))
    return online_softmax(s, v, m, total, acc, dtype, IEEE)


@deferrable
@triton.jit(do_not_specialize=["T"])  # counts: see _common.autotune
def _relative_attention_kernel(
    qkv_ptr,  # [T, 3H]: per row q | k | v, each [heads, HEAD_DIM]
    cu_ptr,  # [B + 1] int32/int64 sequence offsets
    bias_ptr,  # [heads, 2R - 1]: the bias of key - query distance r at column r + R - 1
    y_ptr,  # [T, H] output, qkv's dtype
    T, H, R, qk_scale, stride_qkv, stride_bias, stride_y,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    part = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    pdl_sync(USE_PDL)
    parts = tl.num_programs(0)
    filler = tl.num_programs(1) - 1  # the last grid row: zeros for the rows outside the sequences
    if seq == filler:
        zero_outside(y_ptr, cu_ptr, T, stride_y, head, part, parts, filler, HEAD_DIM, BLOCK_M, BLOCK_D)
    else:
        dims = tl.arange(0, BLOCK_D)
        y_cols = head * HEAD_DIM + dims
        d_ok = dims < HEAD_DIM
        dtype = y_ptr.dtype.element_ty
        start, end = sequence_rows(cu_ptr, seq, T)
        q_col = head * HEAD_DIM
        k_col = H + head * HEAD_DIM
        v_col = 2 * H + head * HEAD_DIM
        # the head's table row, shifted so that index r is distance r
        bias_row = bias_ptr + head.to(tl.int64) * stride_bias + (R - 1)
        last = tl.minimum(end - start, R) - 1  # the farthest distance a bias is read for
        # a sequence longer than the grid's query blocks (longer than max_seqlen) is still computed whole
        for first in range(start + part * BLOCK_M, end, BLOCK_M * parts):
            rows = first + tl.arange(0, BLOCK_M)
            q = load_block(qkv_ptr, rows, end, stride_qkv, q_col, dims, d_ok, HEAD_DIM, BLOCK_D)
            m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
            total = tl.zeros((BLOCK_M,), dtype=tl.float32)
            acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
            for key in range(start, end, BLOCK_N):
                m, total, acc = _attend(q, qkv_ptr, k_col, v_col, bias_row, key, first, end, last, m, total, acc,
                                        qk_scale, stride_qkv, dtype, HEAD_DIM, BLOCK_N, BLOCK_D, IEEE)
            ctx = acc / total[:, None]
            tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + y_cols[None, :], ctx.to(dtype),
                     mask=(rows[:, None] < end) & d_ok[None, :])


def _check(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, num_heads: int, bias: Tensor,
           out: Tensor | None) -> Tensor:
    """The checked offsets (contiguous, on qkv's device)."""
    name = "relative_attention"
    cu_seqlens = check_packed(name, qkv, cu_seqlens, num_heads, out, bias)
    if bias.dim() != 2 or bias.shape[0] != num_heads or bias.shape[1] % 2 == 0:
        raise ValueError(f"{name}: bias must be [num_heads, 2R - 1] = [{num_heads}, odd], got {tuple(bias.shape)}")
    reach = (bias.shape[1] + 1) // 2
    if max_seqlen > reach:
        raise ValueError(f"{name}: max_seqlen {max_seqlen} is past the bias table's reach {reach}")
    return cu_seqlens


def relative_attention(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, num_heads: int, bias: Tensor, *,
                       out: Tensor | None = None) -> Tensor:
    """softmax(q k^T / sqrt(d) + bias[h, j - i]) v per head within each packed sequence: qkv [T, 3H] (query, key and
    value stacked as qkv.view(T, 3, num_heads, d)), cu_seqlens [B + 1] and the bias table bias [num_heads, 2R - 1]
    (key - query distance r at column r + R - 1; any float dtype) on qkv's device -> [T, H] in qkv's dtype, zeros
    outside [cu_seqlens[0], cu_seqlens[-1]); `out` (contiguous [T, H]) is written in place. max_seqlen (a bound, as
    varlen attention takes it, at most R) sizes the blocks and the grid."""
    cu_seqlens = _check(qkv, cu_seqlens, max_seqlen, num_heads, bias, out)
    t, hidden = qkv.shape[0], qkv.shape[1] // 3
    d = hidden // num_heads
    if d > MAX_HEAD_DIM or cu_seqlens.numel() - 1 > MAX_SEQUENCES:  # more than the registers or the grid hold
        return reference.relative_attention(qkv, cu_seqlens, max_seqlen, num_heads, bias, out=out)
    y = out if out is not None else torch.empty((t, hidden), dtype=qkv.dtype, device=qkv.device)
    if not y.numel():
        return y
    qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    bias = bias if bias.stride(1) == 1 else bias.contiguous()
    ieee = ieee_products(qkv.dtype)
    shape = launch_shape(max_seqlen, d, ieee)
    _relative_attention_kernel[grid(max_seqlen, shape["BLOCK_M"], cu_seqlens, num_heads)](
        qkv, cu_seqlens, bias, y, t, hidden, (bias.shape[1] + 1) // 2, d**-0.5 * LOG2E, qkv.stride(0),
        bias.stride(0), y.stride(0), HEAD_DIM=d, IEEE=ieee, **shape, **pdl_args(qkv))
    return y
