"""Self-attention over each packed sequence with rotary position embeddings (GTE, ModernBERT, NomicBERT; Qwen3 and
Qwen2 with grouped-query heads, causal, Qwen3's per-head q/k RMSNorm in the rotation pass), flash-attention style,
after one pass that rotates q and k.

Why two kernels: the rotation depends only on the token's position, but inside the attention each query block's
program would rotate every key block it visits again (the cos and sin of a key block's [BLOCK_N, d/2] angles, the
halves held apart for two half-width products). Rotating as they loaded made the attention about twice as slow as
the same kernel on rotated inputs (docs/decisions/0018-rotary-once-before-attention.md); a pass of its own rotates each
row's q and k once, with one row's angles serving all of its heads, and writes them to a scratch [T, 2H] that the
attention reads with qkv's v. What stays fused: the packed layout (no padding), the sliding window, the zeros of the
filler rows, and nothing of the [T, T] scores in memory. A ModernBERT local layer's window stays cheap: only the key
blocks that meet a query block's window are visited, so the attention costs O(T x window), not O(T x length).

Rotation (transformers' rotate_half, dimension i paired with i + d/2): at the token's position t within its sequence
(0-based) and angles a = t * inv_freq in fp32, x' = (x1 cos a - x2 sin a, x2 cos a + x1 sin a) for the halves x1, x2
of each head of q and k, computed in fp32 and rounded once to the input dtype (as the unfused path stores rotated q
and k in the model dtype; fp32 inputs stay fp32). cos and sin are tl.cos / tl.sin of the fp32 angle (the very angle
transformers rounds, position.float() * inv_freq): libdevice's, accurate over the whole range of positions.

Attention, per program (query block, sequence b, head h): q' of the block's rows, then over the sequence's key
blocks: s = q' k'^T / sqrt(d) in log2 units, online softmax (_packed_attention.online_softmax: fp32 running max and
sum, exp2), acc += p v. The key blocks run in one loop, each masked by the sequence's end (as relative_attention's).
With a window (w > 0: keys j with |i - j| <= w), a query block [first, first + BLOCK_M) visits only the keys
[first - w, last query + w] of its sequence, masked by the distance too. The program's query rows past the sequence's
end are computed (from clamped positions) and not stored. Products run on tensor cores in fp16/bf16 with fp32
accumulation, and as IEEE fp32 for fp32 inputs; p goes into the p v product rounded once to the input dtype.

The last grid row writes zeros into the rows outside [cu_seqlens[0], cu_seqlens[-1]) (a graph bucket's filler
tokens), so the output is fully defined.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusedserve.kernels import reference
from fusedserve.kernels.triton import _packed_attention
from fusedserve.kernels.triton._common import deferrable, pdl_args, pdl_sync
from fusedserve.kernels.triton._packed_attention import (LOG2E, MAX_HEAD_DIM, MAX_SEQUENCES, check_packed, grid,
                                                         load_block, ieee_products, online_softmax, zero_outside,
                                                         sequence_rows)


@deferrable
@triton.jit(do_not_specialize=["T"])
def _rotate_kernel(
    qkv_ptr,  # [T, (H + 2 KV) d]: per row q | k | v, H query heads, KV key/value heads, d = HEAD_DIM
    cu_ptr,  # [B + 1] int32/int64 sequence offsets
    inv_freq_ptr,  # [HEAD_DIM / 2] the rotary frequencies (any float dtype, read in fp32)
    q_norm_ptr, k_norm_ptr,  # [HEAD_DIM] each: the per-head RMSNorm weights of q and k (read only with HAS_NORM)
    qk_ptr,  # [T, (H + KV) d] output: rotated q | rotated k, qkv's dtype
    T, eps, stride_qkv, stride_qk,
    HEAD_DIM: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HAS_NORM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """Rows of one sequence, every head of q and k: under HAS_NORM first each head's RMSNorm (x / rms(x) * w, over
    the head's d columns: Qwen3's q and k norms), then x' = (x1 cos a - x2 sin a, x2 cos a + x1 sin a) at
    a = (the row's position in its sequence) * inv_freq, all in fp32, rounded once to the output dtype. A row's
    angles are taken once and serve all of its heads."""
    part = tl.program_id(0)
    seq = tl.program_id(1)
    pdl_sync(USE_PDL)
    parts = tl.num_programs(0)
    HALF: tl.constexpr = HEAD_DIM // 2
    halves = tl.arange(0, BLOCK_H)
    heads = tl.arange(0, BLOCK_HEADS)
    cols = (heads * HEAD_DIM)[None, :, None] + halves[None, None, :]  # [1, heads, half]: a head's first half
    half_ok = (halves < HALF)[None, None, :]
    inv_freq = tl.load(inv_freq_ptr + halves, mask=halves < HALF, other=0.0).to(tl.float32)
    start, end = sequence_rows(cu_ptr, seq, T)
    for first in range(start + part * BLOCK_T, end, BLOCK_T * parts):
        rows = first + tl.arange(0, BLOCK_T)
        # the angles as transformers rounds them: position.float() * inv_freq, libdevice's accurate cos and sin
        angles = (rows - start).to(tl.float32)[:, None, None] * inv_freq[None, None, :]
        cos = tl.cos(angles)
        sin = tl.sin(angles)
        src = qkv_ptr + rows.to(tl.int64)[:, None, None] * stride_qkv + cols
        dst = qk_ptr + rows.to(tl.int64)[:, None, None] * stride_qk + cols
        for which in tl.static_range(2):  # q (HEADS heads from column 0), then k (KV_HEADS from HEADS x d)
            count = HEADS if which == 0 else KV_HEADS
            offset = 0 if which == 0 else HEADS * HEAD_DIM
            mask = (rows < end)[:, None, None] & (heads < count)[None, :, None] & half_ok
            x1 = tl.load(src + offset, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(src + offset + HALF, mask=mask, other=0.0).to(tl.float32)
            if HAS_NORM:
                w_ptr = q_norm_ptr if which == 0 else k_norm_ptr
                w1 = tl.load(w_ptr + halves, mask=halves < HALF, other=0.0).to(tl.float32)[None, None, :]
                w2 = tl.load(w_ptr + HALF + halves, mask=halves < HALF, other=0.0).to(tl.float32)[None, None, :]
                # padding lanes hold zeros: the sums are the head's own
                mean_square = (tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2)) / HEAD_DIM
                scale = (1.0 / tl.sqrt(mean_square + eps))[:, :, None]
                x1 = x1 * scale * w1
                x2 = x2 * scale * w2
            tl.store(dst + offset, (x1 * cos - x2 * sin).to(qk_ptr.dtype.element_ty), mask=mask)
            tl.store(dst + offset + HALF, (x2 * cos + x1 * sin).to(qk_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attend(q, qk_ptr, v_ptr, k_col, v_col, key, end, first, window, m, total, acc, qk_scale, stride_qk, stride_v,
            dtype, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
            WINDOWED: tl.constexpr, CAUSAL: tl.constexpr):
    """One key block of online-softmax attention: m, total and acc after the keys key .. key + BLOCK_N for the
    (rotated) queries q of rows first .. first + BLOCK_M, the keys at or past `end` left out, under WINDOWED those
    farther than `window` from the query too, and under CAUSAL those after it."""
    BLOCK_M: tl.constexpr = q.shape[0]
    keys = key + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    kv_mask = keys[:, None] < end
    if BLOCK_D != HEAD_DIM:
        kv_mask = kv_mask & (dims[None, :] < HEAD_DIM)
    k = tl.load(qk_ptr + keys[:, None].to(tl.int64) * stride_qk + (k_col + dims)[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + keys[:, None].to(tl.int64) * stride_v + (v_col + dims)[None, :], mask=kv_mask, other=0.0)
    # s = q' k'^T / sqrt(d) * log2(e): softmax by exp2
    if IEEE:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    keep = keys[None, :] < end
    if WINDOWED or CAUSAL:
        distance = keys[None, :] - (first + tl.arange(0, BLOCK_M))[:, None]
        if WINDOWED:
            keep = keep & (distance <= window) & (distance >= -window)
        if CAUSAL:
            keep = keep & (distance <= 0)
    s = tl.where(keep, s * qk_scale, float("-inf"))
    return online_softmax(s, v, m, total, acc, dtype, IEEE)


@deferrable
@triton.jit(do_not_specialize=["T", "window"])  # counts: see _common.autotune
def _rotary_attention_kernel(
    qk_ptr,  # [T, (H + KV) d]: per row the rotated q | k
    v_ptr,  # qkv [T, (H + 2 KV) d]: v in its last KV x d columns
    cu_ptr,  # [B + 1] int32/int64 sequence offsets
    y_ptr,  # [T, H d] output, qkv's dtype
    T, window, qk_scale, stride_qk, stride_v, stride_y,
    HEAD_DIM: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr, WINDOWED: tl.constexpr, CAUSAL: tl.constexpr,
    USE_PDL: tl.constexpr = False,
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
        dtype = y_ptr.dtype.element_ty
        dims = tl.arange(0, BLOCK_D)
        d_ok = dims < HEAD_DIM
        y_cols = head * HEAD_DIM + dims
        start, end = sequence_rows(cu_ptr, seq, T)
        # grouped-query heads: query heads h of one group of HEADS / KV_HEADS share key/value head h // group
        kv_head = head // (HEADS // KV_HEADS)
        q_col = head * HEAD_DIM
        k_col = (HEADS + kv_head) * HEAD_DIM
        v_col = (HEADS + KV_HEADS + kv_head) * HEAD_DIM
        # a sequence longer than the grid's query blocks (longer than max_seqlen) is still computed whole
        for first in range(start + part * BLOCK_M, end, BLOCK_M * parts):
            rows = first + tl.arange(0, BLOCK_M)
            q = load_block(qk_ptr, rows, end, stride_qk, q_col, dims, d_ok, HEAD_DIM, BLOCK_D)
            m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
            total = tl.zeros((BLOCK_M,), dtype=tl.float32)
            acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
            lo = start
            hi = end
            # only the keys some query row of the block may see: the blocks outside are never visited
            if WINDOWED:
                lo = tl.maximum(start, first - window)
                hi = tl.minimum(end, tl.minimum(first + BLOCK_M, end) + window)  # past the last row's reach
            if CAUSAL:
                hi = tl.minimum(hi, first + BLOCK_M)  # up to the block's last row
            # one loop, every block masked (the last one's keys past the sequence's end; under a window the keys out
            # of reach): _packed_attention.launch_shape says why
            for key in range(lo, hi, BLOCK_N):
                m, total, acc = _attend(q, qk_ptr, v_ptr, k_col, v_col, key, end, first, window, m, total, acc,
                                        qk_scale, stride_qk, stride_v, dtype, HEAD_DIM, BLOCK_N, BLOCK_D, IEEE,
                                        WINDOWED, CAUSAL)
            if WINDOWED:  # the block's rows past the sequence's end may meet no key (not stored): no 0 / 0
                total = tl.where(total > 0, total, 1.0)
            ctx = acc / total[:, None]
            tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + y_cols[None, :], ctx.to(dtype),
                     mask=(rows[:, None] < end) & d_ok[None, :])


def windowed(max_seqlen: int, window: int) -> bool:
    """Whether a window restricts anything: not when it reaches across the longest sequence the bound allows (every
    |i - j| <= max_seqlen - 1); then the kernel compiled without the window runs (no distance mask)."""
    return 0 < window < max_seqlen - 1


def launch_shape(max_seqlen: int, head_dim: int, ieee: bool = False, window: int = 0) -> dict:
    """relative_attention's rule (_packed_attention.launch_shape), and two of this op's own, measured on the H200
    (docs/decisions/0020-rotary-attention-shapes-for-wide-heads.md):
    - Under a window at most 64 queries a program: a query block of BLOCK_M visits BLOCK_M + 2 x window keys, so at
      ModernBERT's window of 64 a block of 128 queries spends 256 key columns where 64 queries spend 192 (the ideal
      is 129).
    - Heads wider than 64 (Qwen3's 128): up to a bound of 512 tokens (every CUDA-graph bucket), 64 queries on 4 warps
      (one warp group, the tile a Hopper tensor-core instruction takes) over 32 keys a step, which a short causal key
      loop fills best; past it (a long input, run eagerly with its own length as the bound), 128 queries on 8 warps
      over 64 keys a step, three stages in flight."""
    shape = _packed_attention.launch_shape(max_seqlen, head_dim, ieee)
    if windowed(max_seqlen, window) and shape["BLOCK_M"] > 64:
        warps = 8 if shape["BLOCK_D"] > 64 else 4
        shape.update(BLOCK_M=64, num_warps=warps, num_stages=2)
    elif not ieee and shape["BLOCK_D"] > 64 and max_seqlen > 64:
        if max_seqlen <= 512:
            shape.update(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
        else:
            shape.update(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    return shape


def rotate_shape(num_heads: int, head_dim: int) -> dict:
    """The rotation pass's tiles: [BLOCK_T rows, every query head, half a head] of about 4096 elements (rows of
    several heads' halves at once: the angles of a row serve all of them; the fewer key heads of grouped-query
    attention take the same tile, masked), on 4 warps."""
    block_heads = triton.next_power_of_2(num_heads)
    block_h = triton.next_power_of_2(max(head_dim // 2, 1))
    return {"BLOCK_T": max(4096 // (block_heads * block_h), 1), "BLOCK_HEADS": block_heads, "BLOCK_H": block_h,
            "num_warps": 4}


def rotate_qk(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, num_heads: int, inv_freq: Tensor, num_kv_heads: int,
              q_norm: Tensor | None, k_norm: Tensor | None, norm_eps: float) -> Tensor:
    """The rotation pass alone: qkv [T, (H + 2 KV) d] (unit column stride, checked offsets) -> [T, (H + KV) d], each
    head of q and k RMS-normed (with q_norm / k_norm) and rotated by its row's position in its sequence; rows outside
    every sequence are left unwritten. rotary_attention's first launch, and the bench's q/k norm + RoPE cell."""
    t, d = qkv.shape[0], qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    qk = torch.empty((t, (num_heads + num_kv_heads) * d), dtype=qkv.dtype, device=qkv.device)
    rotate = rotate_shape(num_heads, d)
    norms = (inv_freq, inv_freq) if q_norm is None else (q_norm.contiguous(), k_norm.contiguous())  # unread: none
    _rotate_kernel[(triton.cdiv(max(max_seqlen, 1), rotate["BLOCK_T"]), cu_seqlens.numel() - 1)](
        qkv, cu_seqlens, inv_freq.contiguous(), *norms, qk, t, norm_eps, qkv.stride(0), qk.stride(0), HEAD_DIM=d,
        HEADS=num_heads, KV_HEADS=num_kv_heads, HAS_NORM=q_norm is not None, **rotate, **pdl_args(qkv))
    return qk


def _check(qkv: Tensor, cu_seqlens: Tensor, num_heads: int, inv_freq: Tensor, window: int, num_kv_heads: int,
           causal: bool, q_norm: Tensor | None, k_norm: Tensor | None, out: Tensor | None) -> Tensor:
    """The checked offsets (contiguous, on qkv's device)."""
    name = "rotary_attention"
    cu_seqlens = check_packed(name, qkv, cu_seqlens, num_heads, out, inv_freq, num_kv_heads=num_kv_heads)
    d = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    if d % 2:
        raise ValueError(f"{name}: the rotary embedding pairs dimension i with i + d/2: heads of {d} columns (odd) "
                         "have no such pairs")
    if inv_freq.dim() != 1 or inv_freq.numel() != d // 2:
        raise ValueError(f"{name}: inv_freq must be [head_dim / 2] = [{d // 2}], got {tuple(inv_freq.shape)}")
    if window < 0:
        raise ValueError(f"{name}: window must be 0 (none) or a positive distance, got {window}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError(f"{name}: q_norm and k_norm come together (a model with per-head norms has both)")
    for label, weight in (("q_norm", q_norm), ("k_norm", k_norm)):
        if weight is not None and (weight.dim() != 1 or weight.numel() != d or weight.device != qkv.device):
            raise ValueError(f"{name}: {label} must be the head's [{d}] norm weight on {qkv.device}, got "
                             f"{tuple(weight.shape)} on {weight.device}")
    return cu_seqlens


def rotary_attention(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, num_heads: int, inv_freq: Tensor,
                     window: int = 0, num_kv_heads: int | None = None, causal: bool = False,
                     q_norm: Tensor | None = None, k_norm: Tensor | None = None, norm_eps: float = 1e-6, *,
                     out: Tensor | None = None) -> Tensor:
    """softmax(rot(q) rot(k)^T / sqrt(d)) v per head within each packed sequence: qkv [T, (H + 2 KV) d] (num_heads
    query heads, then num_kv_heads key and value heads, each d wide, d even; KV = num_heads unless given, else a
    divisor of it: grouped-query attention), cu_seqlens [B + 1] and the rotary frequencies inv_freq [d / 2] (any
    float dtype, read in fp32) on qkv's device -> [T, H d] in qkv's dtype, zeros outside
    [cu_seqlens[0], cu_seqlens[-1]); rot rotates by the token's position within its sequence (transformers'
    rotate_half). window > 0: keys at most that far from the query only; causal: keys at or before the query only.
    q_norm, k_norm [d] (together): each head of q and k RMS-normed (eps norm_eps) with them before the rotation
    (Qwen3). `out` (contiguous [T, H d]) is written in place. max_seqlen (a bound, as varlen attention takes it) sizes
    the blocks and the grid."""
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    cu_seqlens = _check(qkv, cu_seqlens, num_heads, inv_freq, window, kv_heads, causal, q_norm, k_norm, out)
    t = qkv.shape[0]
    d = qkv.shape[1] // (num_heads + 2 * kv_heads)
    if d > MAX_HEAD_DIM or cu_seqlens.numel() - 1 > MAX_SEQUENCES:  # more than the registers or the grid hold
        return reference.rotary_attention(qkv, cu_seqlens, max_seqlen, num_heads, inv_freq, window,
                                          num_kv_heads=num_kv_heads, causal=causal, q_norm=q_norm, k_norm=k_norm,
                                          norm_eps=norm_eps, out=out)
    y = out if out is not None else torch.empty((t, num_heads * d), dtype=qkv.dtype, device=qkv.device)
    if not y.numel():
        return y
    qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    pdl = pdl_args(qkv)
    # the rotated q and k, each row's once, then attention over them and qkv's v
    qk = rotate_qk(qkv, cu_seqlens, max_seqlen, num_heads, inv_freq, kv_heads, q_norm, k_norm, norm_eps)
    ieee = ieee_products(qkv.dtype)
    shape = launch_shape(max_seqlen, d, ieee, window)
    _rotary_attention_kernel[grid(max_seqlen, shape["BLOCK_M"], cu_seqlens, num_heads)](
        qk, qkv, cu_seqlens, y, t, window, d**-0.5 * LOG2E, qk.stride(0), qkv.stride(0), y.stride(0), HEAD_DIM=d,
        HEADS=num_heads, KV_HEADS=kv_heads, IEEE=ieee, WINDOWED=windowed(max_seqlen, window), CAUSAL=causal,
        **shape, **pdl)
    return y
