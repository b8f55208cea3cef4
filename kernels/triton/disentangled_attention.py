"""Self-attention over each packed sequence with DeBERTa's disentangled relative attention, flash-attention style.

Why: DeBERTa-v2/v3 add two position terms to every head's content score, s(i, j) = (q_i . k_j + q_i . Pk[r(i - j)]
+ k_j . Pq[r(i - j)]) * scale, where Pk and Pq are the relative table projected by the layer's key and query
projections and r the table row of each query - key distance (log-bucketed past position_buckets / 2). Unlike MPNet's
bias the terms depend on the content, so transformers computes q Pk^T and k Pq^T ([batch, heads, seq, 2 span]
each), gathers both to [batch, heads, seq, seq] and adds them to padded scores: several score-sized tensors a layer
written and read, and varlen flash attention takes no bias at all.

Here no score-sized tensor is ever written. Within a square [BLOCK, BLOCK] tile of scores the distance is constant
along each diagonal, so the tile needs the table rows of 2 BLOCK - 1 consecutive distances. The program loads them
(a strip indexed by distance, so any row vector works: log buckets, clamps) in two chunks of BLOCK rows and computes
the position terms on the tensor cores, q Pk_chunk^T and k Pq_chunk^T ([BLOCK, BLOCK] fp32 each), then spreads them
over the tile by diagonal with tl.gather: c2p(i, j) is row i's entry at strip position i - j + BLOCK - 1, in the first
chunk where i <= j and the second where i > j. The p2c strip runs the other way (position j - i + BLOCK - 1, from the
tile's largest distance down), so its products, indexed [key, query], take the very same gather index and chunk mask
and are transposed onto the tile: one index tensor and one mask serve all four gathers, which keeps them in registers
beside the scores (the register budget is what limits this kernel; launch_shape). The cost is four more
[BLOCK, BLOCK, d] products a tile beside q k^T and p v (flash attention at these lengths is bound by memory and
latency, not the tensor cores); the position terms stay in fp32 (transformers rounds them to the input dtype); the
projected tables (a few hundred KB a layer) are read from L2. The alternative of precomputing q Pk^T and k Pq^T with
cuBLAS and gathering them inside the loop writes and re-reads two [T, heads, 2 span] tensors a layer: several times
the bytes of q, k and v themselves.

Per program (query block, sequence b, head h), as relative_attention's: q = the block's rows of the head's query
columns, then over the key blocks of the same sequence: s = the three terms in log2 units, online softmax in fp32
(_packed_attention.online_softmax), acc += p v. Products run on tensor cores in fp16/bf16 with fp32 accumulation, and
in IEEE fp32 for fp32 inputs. Either position term may be off (pos_att_type), both off being plain attention with
DeBERTa's scale. The last grid row writes zeros into the rows outside [cu_seqlens[0], cu_seqlens[-1]).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusedserve.kernels import reference
from fusedserve.kernels.triton._common import deferrable, pdl_args, pdl_sync
from fusedserve.kernels.triton._packed_attention import (LOG2E, MAX_HEAD_DIM, MAX_SEQUENCES, check_packed, grid,
                                                         load_block, ieee_products, online_softmax, zero_outside,
                                                         sequence_rows)


@triton.jit
def _position_products(x, table_ptr, rows_ptr, first_distance, step, last, table_rows, stride_table, dims,
                       HEAD_DIM: tl.constexpr, WIDTH: tl.constexpr, IEEE: tl.constexpr):
    """x [rows, BLOCK_D] (q or k) times the table rows of the distances first_distance + step * t, t = 0 .. WIDTH - 1
    -> [rows, WIDTH] fp32. Distances clamp to +-last; rows to the table (a row vector pointing past it cannot read
    outside it)."""
    distances = first_distance + step * tl.arange(0, WIDTH)
    pos_rows = tl.load(rows_ptr + tl.minimum(tl.maximum(distances, -last), last)).to(tl.int32)
    pos_rows = tl.minimum(tl.maximum(pos_rows, 0), table_rows - 1).to(tl.int64)
    table = tl.load(table_ptr + pos_rows[:, None] * stride_table + dims[None, :], mask=dims[None, :] < HEAD_DIM,
                    other=0.0)
    if IEEE:
        return tl.dot(x.to(tl.float32), tl.trans(table.to(tl.float32)), input_precision="ieee")
    return tl.dot(x, tl.trans(table))


@triton.jit
def _attend(q, qkv_ptr, k_col, v_col, pk_ptr, pq_ptr, rows_ptr, key, first, end, last, table_rows, m, total, acc,
            qk_scale, stride_qkv, stride_pk, stride_pq, dtype, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr, C2P: tl.constexpr, P2C: tl.constexpr, IEEE: tl.constexpr):
    """One key block of online-softmax attention: the running max m, sum `total` and accumulator acc after the keys
    key .. key + BLOCK_N (those at or past `end` left out) for the queries first .. first + BLOCK_M."""
    BLOCK_M: tl.constexpr = q.shape[0]
    keys = key + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    kv_rows = keys[:, None].to(tl.int64) * stride_qkv
    kv_mask = keys[:, None] < end
    if BLOCK_D != HEAD_DIM:
        kv_mask = kv_mask & (dims[None, :] < HEAD_DIM)
    k = tl.load(qkv_ptr + kv_rows + (k_col + dims)[None, :], mask=kv_mask, other=0.0)
    v = tl.load(qkv_ptr + kv_rows + (v_col + dims)[None, :], mask=kv_mask, other=0.0)
    if IEEE:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if C2P or P2C:
        # c2p's strip position t = i - j + BLOCK_N - 1 holds distance (first - key - (BLOCK_N - 1)) + t, p2c's position
        # u = j - i + BLOCK_N - 1 distance (first - key + BLOCK_M - 1) - u: both at local position t mod BLOCK of the
        # first chunk where t < BLOCK, else of the second. Distances clamp to +-last (the sequence's last position, at
        # most R - 1): only the tile's padding (keys masked out below, query rows never stored) and the second chunk's
        # last position (2 BLOCK - 1, past the tile) read a clamped one.
        tl.static_assert(BLOCK_M == BLOCK_N, "the position terms take square tiles")
        diagonal = tl.arange(0, BLOCK_M)[:, None] - tl.arange(0, BLOCK_N)[None, :] + (BLOCK_N - 1)
        local = diagonal & (BLOCK_N - 1)
        upper = diagonal < BLOCK_N
        if C2P:
            first_distance = first - key - (BLOCK_N - 1)
            lo = _position_products(q, pk_ptr, rows_ptr, first_distance, 1, last, table_rows, stride_pk, dims,
                                    HEAD_DIM, BLOCK_N, IEEE)
            hi = _position_products(q, pk_ptr, rows_ptr, first_distance + BLOCK_N, 1, last, table_rows, stride_pk,
                                    dims, HEAD_DIM, BLOCK_N, IEEE)
            s += tl.where(upper, tl.gather(lo, local, 1), tl.gather(hi, local, 1))  # c2p(i, j) = q_i . Pk[r(i - j)]
        if P2C:
            first_distance = first - key + (BLOCK_M - 1)
            lo = _position_products(k, pq_ptr, rows_ptr, first_distance, -1, last, table_rows, stride_pq, dims,
                                    HEAD_DIM, BLOCK_N, IEEE)
            hi = _position_products(k, pq_ptr, rows_ptr, first_distance - BLOCK_N, -1, last, table_rows, stride_pq,
                                    dims, HEAD_DIM, BLOCK_N, IEEE)
            # [key, query] -> the tile: p2c(i, j) = k_j . Pq[r(i - j)]
            s += tl.trans(tl.where(upper, tl.gather(lo, local, 1), tl.gather(hi, local, 1)))
    # s = (q k^T + c2p + p2c) * scale * log2(e): softmax by exp2
    s = tl.where(keys[None, :] < end, s * qk_scale, float("-inf"))
    return online_softmax(s, v, m, total, acc, dtype, IEEE)


@deferrable
@triton.jit(do_not_specialize=["T"])  # counts: see _common.autotune
def _disentangled_attention_kernel(
    qkv_ptr,  # [T, 3H]: per row q | k | v, each [heads, HEAD_DIM]
    cu_ptr,  # [B + 1] int32/int64 sequence offsets
    rows_ptr,  # [2R - 1] int32/int64: the table row of query - key distance r at index r + R - 1
    pk_ptr,  # [P, H]: the relative table projected for c2p (heads along columns as qkv's); unread without C2P
    pq_ptr,  # [P, H]: the relative table projected for p2c; unread without P2C
    y_ptr,  # [T, H] output, qkv's dtype
    T, H, R, P, qk_scale, stride_qkv, stride_pk, stride_pq, stride_y,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    C2P: tl.constexpr, P2C: tl.constexpr, IEEE: tl.constexpr, USE_PDL: tl.constexpr = False,
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
        rows_at = rows_ptr + (R - 1)  # shifted so that index r is distance r
        pk_head = pk_ptr + head * HEAD_DIM
        pq_head = pq_ptr + head * HEAD_DIM
        last = tl.minimum(end - start, R) - 1  # the farthest distance a table row is read for
        # a sequence longer than the grid's query blocks (longer than max_seqlen) is still computed whole
        for first in range(start + part * BLOCK_M, end, BLOCK_M * parts):
            rows = first + tl.arange(0, BLOCK_M)
            q = load_block(qkv_ptr, rows, end, stride_qkv, q_col, dims, d_ok, HEAD_DIM, BLOCK_D)
            m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
            total = tl.zeros((BLOCK_M,), dtype=tl.float32)
            acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
            for key in range(start, end, BLOCK_N):
                m, total, acc = _attend(q, qkv_ptr, k_col, v_col, pk_head, pq_head, rows_at, key, first, end, last,
                                        P, m, total, acc, qk_scale, stride_qkv, stride_pk, stride_pq, dtype,
                                        HEAD_DIM, BLOCK_N, BLOCK_D, C2P, P2C, IEEE)
            ctx = acc / total[:, None]
            tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + y_cols[None, :], ctx.to(dtype),
                     mask=(rows[:, None] < end) & d_ok[None, :])


def launch_shape(max_seqlen: int, head_dim: int, ieee: bool = False) -> dict:
    """Rules, not autotuning (the registry races backends at start-up; a graph bucket's max_seqlen picks one shape).
    Square tiles (the position terms' diagonal gathers take them), and registers decide the rest: beside the scores and
    the accumulator a tile holds a position product [BLOCK, BLOCK] fp32, the gather index and its chunk mask (sm_90
    compile, ptxas -v: 64 x 64 on 4 warps at head_dim 64 with both terms spills a few words, 32 x 32 none, 128 x 128
    on 8 warps spills heavily). Eight warps on 64 queries would not help: the scores feed the p v product as its
    first operand, so Triton lays them out one warp per 16 rows and a second warpgroup repeats the first's work.
    - Sequences of at most 64 tokens: blocks of the bound rounded up to a power of two (at least 16, tl.dot's least).
    - Longer ones: 64 x 64 on 4 warps (one Hopper warpgroup), where relative_attention takes 128 queries a program
      from 256 tokens on.
    - fp32 (IEEE products on the FMA units, their operands in registers): 32 x 32 at most on 8 warps, as
      relative_attention's. It spills there (16 x 16 would not), but fp32 is the exact path rather than the serving
      one, and on the interpreter, where bf16 takes it too (_packed_attention.ieee_products), the cost is per tile."""
    block_d = max(triton.next_power_of_2(head_dim), 16)
    block = min(max(triton.next_power_of_2(max(max_seqlen, 1)), 16), 32 if ieee else 64)
    warps = 8 if ieee and block >= 32 else 4
    return {"BLOCK_M": block, "BLOCK_N": block, "BLOCK_D": block_d, "num_warps": warps, "num_stages": 2}


def _check(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, num_heads: int, pos_key: Tensor | None,
           pos_query: Tensor | None, rows: Tensor, out: Tensor | None) -> Tensor:
    """The checked offsets (contiguous, on qkv's device)."""
    name = "disentangled_attention"
    tables = [t for t in (pos_key, pos_query) if t is not None]
    cu_seqlens = check_packed(name, qkv, cu_seqlens, num_heads, out, *tables)
    hidden = qkv.shape[1] // 3
    for what, table in (("pos_key", pos_key), ("pos_query", pos_query)):
        if table is None:
            continue
        if table.dim() != 2 or table.shape[1] != hidden or table.shape[0] < 1 or table.dtype != qkv.dtype:
            raise ValueError(f"{name}: {what} must be a [P, {hidden}] {qkv.dtype} table, got "
                             f"{tuple(table.shape)} {table.dtype}")
    if len(tables) == 2 and pos_key.shape[0] != pos_query.shape[0]:
        raise ValueError(f"{name}: pos_key and pos_query must have as many rows, got {pos_key.shape[0]} and "
                         f"{pos_query.shape[0]}")
    if rows.dim() != 1 or rows.shape[0] % 2 == 0 or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: rows must be a [2R - 1] int32/int64 vector, got {tuple(rows.shape)} {rows.dtype}")
    if rows.device != qkv.device:
        raise ValueError(f"{name}: rows is on {rows.device}, qkv on {qkv.device}")
    reach = (rows.shape[0] + 1) // 2
    if max_seqlen > reach:
        raise ValueError(f"{name}: max_seqlen {max_seqlen} is past the row vector's reach {reach}")
    return cu_seqlens


def disentangled_attention(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, num_heads: int,
                           pos_key: Tensor | None, pos_query: Tensor | None, rows: Tensor, scale: float, *,
                           out: Tensor | None = None) -> Tensor:
    """softmax((q_i . k_j + q_i . Pk[r] + k_j . Pq[r]) * scale) v per head within each packed sequence, r =
    rows[i - j + R - 1]: qkv [T, 3H] (qkv.view(T, 3, num_heads, d)), cu_seqlens [B + 1], the projected tables pos_key
    and pos_query [P, H] in qkv's dtype (None: that term off) and the row vector rows [2R - 1] (entries in [0, P)) on
    qkv's device -> [T, H] in qkv's dtype, zeros outside [cu_seqlens[0], cu_seqlens[-1]); `out` (contiguous [T, H])
    is written in place. max_seqlen (a bound, as varlen attention takes it, at most R) sizes the blocks and the
    grid."""
    cu_seqlens = _check(qkv, cu_seqlens, max_seqlen, num_heads, pos_key, pos_query, rows, out)
    t, hidden = qkv.shape[0], qkv.shape[1] // 3
    d = hidden // num_heads
    if d > MAX_HEAD_DIM or cu_seqlens.numel() - 1 > MAX_SEQUENCES:  # more than the registers or the grid hold
        return reference.disentangled_attention(qkv, cu_seqlens, max_seqlen, num_heads, pos_key, pos_query, rows,
                                                scale, out=out)
    y = out if out is not None else torch.empty((t, hidden), dtype=qkv.dtype, device=qkv.device)
    if not y.numel():
        return y
    qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    pos_key, pos_query = (p if p is None or p.stride(1) == 1 else p.contiguous() for p in (pos_key, pos_query))
    rows = rows.contiguous()
    # a term that is off passes qkv in its table's place: a pointer of the same type, never read (C2P / P2C)
    pk = pos_key if pos_key is not None else qkv
    pq = pos_query if pos_query is not None else qkv
    table_rows = (pos_key if pos_key is not None else pos_query if pos_query is not None else qkv).shape[0]
    ieee = ieee_products(qkv.dtype)
    shape = launch_shape(max_seqlen, d, ieee)
    _disentangled_attention_kernel[grid(max_seqlen, shape["BLOCK_M"], cu_seqlens, num_heads)](
        qkv, cu_seqlens, rows, pk, pq, y, t, hidden, (rows.shape[0] + 1) // 2, table_rows, scale * LOG2E,
        qkv.stride(0), pk.stride(0), pq.stride(0), y.stride(0), HEAD_DIM=d, C2P=pos_key is not None,
        P2C=pos_query is not None, IEEE=ieee, **shape, **pdl_args(qkv))
    return y
