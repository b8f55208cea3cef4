"""Self-attention over each packed sequence with a relative position bias (MPNet's), flash-attention style.

Why: MPNet adds B[h, j - i] to every head's scores, a bias that depends only on the head and the distance between
key j and query i. Unfused, that is a [batch, heads, seq, seq] bias added to padded scores (transformers' way): varlen
flash attention takes no bias. Here the bias comes from the [heads, 2R - 1] table of biases by distance: within a
[BLOCK_M, BLOCK_N] tile of scores the distance is constant along each diagonal (a Toeplitz tile), so a tile needs
BLOCK_M + BLOCK_N - 1 consecutive entries of its head's row of the table. The program loads that strip and spreads
it over the tile with tl.gather; the table (a few KB a head) stays in L1 and L2. No [heads, T, T] bias is ever built.

Per program (query block, sequence b, head h): q = the block's rows of the head's query columns, then over the key
blocks of the same sequence: s = q k^T / sqrt(d) + B[h, j - i] in log2 units, online softmax (running max and sum
in fp32, exp2), acc += p v. The key blocks run unmasked up to the last whole block and with the key mask only in the
last, partial one; the program's query rows past the sequence's end are computed (from clamped positions) and not
stored. Products run on tensor cores in fp16/bf16 with fp32 accumulation, and in IEEE fp32 for fp32 inputs (as
qkv_attention's _dot). p goes into the p v product rounded once to the input dtype (flash attention's habit): q, k
and v are the op's inputs here, already rounded, so rounding p is the only error past the reference's fp32 and it
stays well inside the fp16 entry of the tolerance table (qkv_attention splits p into two halves because its own
rounding of the projected q, k and v already spends part of that budget).

The last grid row writes zeros into the rows outside [cu_seqlens[0], cu_seqlens[-1]) (a graph bucket's filler
tokens), so the output is fully defined.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusedserve.kernels import reference
from fusedserve.kernels._layout import offsets
from fusedserve.kernels.triton._common import INTERPRET, check_device, deferrable, pdl_args, pdl_sync

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 128  # one head's [BLOCK_M, head_dim] q and accumulator stay in registers; wider: torch
MAX_SEQUENCES = 65535 - 1  # grid axis 1 is sequences + the filler row, and CUDA caps it at 65535
LOG2E = 1.4426950408889634


@triton.jit
def _attend(q, qkv_ptr, k_col, v_col, bias_row, key, first, end, last, m, total, acc, qk_scale, stride_qkv, dtype,
            HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
            MASKED: tl.constexpr):
    """One key block of online-softmax attention: the running max m, sum `total` and accumulator acc after the keys
    key .. key + BLOCK_N (MASKED: those at or past `end` left out; else all of them are the sequence's) for the
    queries first .. first + BLOCK_M."""
    BLOCK_M: tl.constexpr = q.shape[0]
    keys = key + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    rows = keys[:, None].to(tl.int64) * stride_qkv
    if MASKED:
        kv_mask = keys[:, None] < end
        if BLOCK_D != HEAD_DIM:
            kv_mask = kv_mask & (dims[None, :] < HEAD_DIM)
        k = tl.load(qkv_ptr + rows + (k_col + dims)[None, :], mask=kv_mask, other=0.0)
        v = tl.load(qkv_ptr + rows + (v_col + dims)[None, :], mask=kv_mask, other=0.0)
    elif BLOCK_D != HEAD_DIM:
        k = tl.load(qkv_ptr + rows + (k_col + dims)[None, :], mask=dims[None, :] < HEAD_DIM, other=0.0)
        v = tl.load(qkv_ptr + rows + (v_col + dims)[None, :], mask=dims[None, :] < HEAD_DIM, other=0.0)
    else:
        k = tl.load(qkv_ptr + rows + (k_col + dims)[None, :])
        v = tl.load(qkv_ptr + rows + (v_col + dims)[None, :])
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
    s = s * qk_scale + bias
    if MASKED:
        s = tl.where(keys[None, :] < end, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: every block holds at least one of the sequence's keys
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    total = total * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = tl.dot(p, v.to(tl.float32), acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(dtype), v, acc * alpha[:, None])
    return m_new, total, acc


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
    dims = tl.arange(0, BLOCK_D)
    y_cols = head * HEAD_DIM + dims
    d_ok = dims < HEAD_DIM
    dtype = y_ptr.dtype.element_ty
    if seq == filler:
        # rows [0, cu[0]) and [cu[B], T), this head's columns, spread over the query-block programs
        first_real = tl.minimum(tl.maximum(tl.load(cu_ptr).to(tl.int32), 0), T)
        end_real = tl.minimum(tl.maximum(tl.load(cu_ptr + seq).to(tl.int32), first_real), T)
        zeros = tl.zeros((BLOCK_M, BLOCK_D), dtype=dtype)
        for first in range(part * BLOCK_M, first_real, BLOCK_M * parts):
            rows = first + tl.arange(0, BLOCK_M)
            tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + y_cols[None, :], zeros,
                     mask=(rows[:, None] < first_real) & d_ok[None, :])
        for first in range(end_real + part * BLOCK_M, T, BLOCK_M * parts):
            rows = first + tl.arange(0, BLOCK_M)
            tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + y_cols[None, :], zeros,
                     mask=(rows[:, None] < T) & d_ok[None, :])
    else:
        start = tl.minimum(tl.maximum(tl.load(cu_ptr + seq).to(tl.int32), 0), T)
        end = tl.minimum(tl.maximum(tl.load(cu_ptr + seq + 1).to(tl.int32), start), T)
        q_col = head * HEAD_DIM
        k_col = H + head * HEAD_DIM
        v_col = 2 * H + head * HEAD_DIM
        # the head's table row, shifted so that index r is distance r
        bias_row = bias_ptr + head.to(tl.int64) * stride_bias + (R - 1)
        last = tl.minimum(end - start, R) - 1  # the farthest distance a bias is read for
        full_end = start + (end - start) // BLOCK_N * BLOCK_N  # the keys of whole blocks: no key mask
        # a sequence longer than the grid's query blocks (longer than max_seqlen) is still computed whole
        for first in range(start + part * BLOCK_M, end, BLOCK_M * parts):
            rows = first + tl.arange(0, BLOCK_M)
            q_mask = rows[:, None] < end
            if BLOCK_D != HEAD_DIM:
                q_mask = q_mask & d_ok[None, :]
            q = tl.load(qkv_ptr + rows[:, None].to(tl.int64) * stride_qkv + (q_col + dims)[None, :], mask=q_mask,
                        other=0.0)
            m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
            total = tl.zeros((BLOCK_M,), dtype=tl.float32)
            acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
            for key in range(start, full_end, BLOCK_N):
                m, total, acc = _attend(q, qkv_ptr, k_col, v_col, bias_row, key, first, end, last, m, total, acc,
                                        qk_scale, stride_qkv, dtype, HEAD_DIM, BLOCK_N, BLOCK_D, IEEE, False)
            if full_end < end:
                m, total, acc = _attend(q, qkv_ptr, k_col, v_col, bias_row, full_end, first, end, last, m, total, acc,
                                        qk_scale, stride_qkv, dtype, HEAD_DIM, BLOCK_N, BLOCK_D, IEEE, True)
            ctx = acc / total[:, None]
            tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + y_cols[None, :], ctx.to(dtype),
                     mask=(rows[:, None] < end) & d_ok[None, :])


def launch_shape(max_seqlen: int, head_dim: int, ieee: bool = False) -> dict:
    """Rules, not autotuning (the registry races backends at start-up; a graph bucket's max_seqlen picks one shape).
    Register pressure decides most of it: a tile's score, bias and probability blocks live beside the accumulator.
    In half precision at the head widths models use (32, 64, 128), and in fp32 up to head_dim 64, no shape below
    spills registers in the sm_90 compile (ptxas -v); odd widths padded to a power of two may.
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


def _check(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, num_heads: int, bias: Tensor,
           out: Tensor | None) -> Tensor:
    """The checked offsets (contiguous, on qkv's device)."""
    name = "relative_attention"
    check_device(name, qkv, bias)
    if qkv.dtype not in DTYPES:
        raise TypeError(f"{name}: qkv must be one of {DTYPES}, got {qkv.dtype}")
    if qkv.dim() != 2 or qkv.shape[1] % 3:
        raise ValueError(f"{name}: qkv must be [T, 3H] (query, key and value stacked), got {tuple(qkv.shape)}")
    hidden = qkv.shape[1] // 3
    if num_heads < 1 or hidden % num_heads:
        raise ValueError(f"{name}: {num_heads} heads do not split {hidden} columns")
    if bias.dim() != 2 or bias.shape[0] != num_heads or bias.shape[1] % 2 == 0:
        raise ValueError(f"{name}: bias must be [num_heads, 2R - 1] = [{num_heads}, odd], got {tuple(bias.shape)}")
    reach = (bias.shape[1] + 1) // 2
    if max_seqlen > reach:
        raise ValueError(f"{name}: max_seqlen {max_seqlen} is past the bias table's reach {reach}")
    shape = (qkv.shape[0], hidden)
    if out is not None and (out.shape != shape or out.dtype != qkv.dtype or not out.is_contiguous()):
        raise ValueError(f"{name}: out must be a contiguous {qkv.dtype} tensor of shape {shape}")
    return offsets(name, qkv, cu_seqlens)


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
    ieee = qkv.dtype == torch.float32 or (INTERPRET and qkv.dtype == torch.bfloat16)  # the interpreter's bf16 dot
    shape = launch_shape(max_seqlen, d, ieee)
    grid = (triton.cdiv(max(max_seqlen, 1), shape["BLOCK_M"]), cu_seqlens.numel(), num_heads)
    _relative_attention_kernel[grid](
        qkv, cu_seqlens, bias, y, t, hidden, (bias.shape[1] + 1) // 2, d**-0.5 * LOG2E, qkv.stride(0),
        bias.stride(0), y.stride(0), HEAD_DIM=d, IEEE=ieee, **shape, **pdl_args(qkv))
    return y
