"""A layer's QKV projection and self-attention over each packed sequence in one kernel.

Why: at a single short request (MiniLM b1 s16) every kernel is latency. Unfused, a layer's attention block is three
kernels, the QKV GEMM (cuBLAS), a memset and the SDPA kernel, plus their boundaries in the CUDA graph (the profile
suite, docs/performance.md). Attention of short sequences needs only its own head's slice of the projection, so one
program per (sequence, head) can project its tokens and attend without meeting any other program: no workspace, no
counters (what made the split GEMM + LayerNorm lose, docs/decisions/0001-split-gemm-layer-norm.md).

Per program (sequence b, head h, query block): q = x[block] Wq_h^T + bq_h, then flash-style over key blocks of the
same sequence: k, v = x[keys] Wk_h^T + bk_h, x[keys] Wv_h^T + bv_h, online softmax (running max and sum in fp32),
acc += p v. A sequence within one block (a short request) has its queries as its keys: q, k and v are projected in
one pass over x (each step one x tile and three weight tiles in flight, fewer round trips than three passes). The
projections accumulate in fp32 and are rounded to the input dtype
before the attention products, as the unfused path stores them (fp32 inputs use IEEE products); p goes into the p v
product as two halves in the input dtype, so it is not rounded (one rounding of p put single elements past the fp16
tolerance). With `attention_partials` the context (rounded the same way) is multiplied by the head's slice of the
output projection in the same program, giving that head's fp32 partial sum of the projected output. A sequence
longer than one block re-projects its keys for every query block (work grows with length / BLOCK): this is for short
sequences: the encoder's few-token layer (batches of <= 64 tokens, the GPU default) and, with `attention="fused"`
where varlen attention does not run, every layer. The weights a program reads are its head's 3 x head_dim rows, so
the grid spreads the projection's weight traffic over heads x sequences SMs.

The last grid row writes zeros into the rows past cu_seqlens[-1] (a graph bucket's filler tokens), so the output
is fully defined.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusedserve.kernels import reference
from fusedserve.kernels._layout import offsets, segment_arguments
from fusedserve.kernels.triton._common import INTERPRET, check_device, deferrable, pdl_args, pdl_sync

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 128  # one head's [BLOCK, head_dim] q, k, v and accumulator stay in registers; wider: torch
LOG2E = 1.4426950408889634


@triton.jit
def _project(x_ptr, w_ptr, b_ptr, first, end, H, D, stride_x, stride_w,
             BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """x[first : first + BLOCK] @ W^T + b for one head's [D, H] slice W of the QKV weight (rows past `end` read as
    0): [BLOCK, BLOCK_D] in fp32."""
    rows = first + tl.arange(0, BLOCK)
    dims = tl.arange(0, BLOCK_D)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :]
    w_ptrs = w_ptr + dims[None, :] * stride_w + ks[:, None]  # W^T tile [BLOCK_K, BLOCK_D]
    acc = tl.zeros((BLOCK, BLOCK_D), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        a = tl.load(x_ptrs, mask=(rows[:, None] < end) & (ks[None, :] < H - k0), other=0.0)
        b = tl.load(w_ptrs, mask=(ks[:, None] < H - k0) & (dims[None, :] < D), other=0.0)
        if IEEE:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    bias = tl.load(b_ptr + dims, mask=dims < D, other=0.0).to(tl.float32)
    return acc + bias[None, :]


@triton.jit
def _project_qkv(x_ptr, wq, wk, wv, bq, bk, bv, first, end, H, D, stride_x, stride_w,
                 BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """_project for q, k and v of the same rows in one pass over x: each step loads its x tile once and has the three
    weight tiles in flight together (three passes wait out three chains of loads)."""
    rows = first + tl.arange(0, BLOCK)
    dims = tl.arange(0, BLOCK_D)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :]
    w_offs = dims[None, :] * stride_w + ks[:, None]
    q = tl.zeros((BLOCK, BLOCK_D), dtype=tl.float32)
    k = tl.zeros((BLOCK, BLOCK_D), dtype=tl.float32)
    v = tl.zeros((BLOCK, BLOCK_D), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        a = tl.load(x_ptrs, mask=(rows[:, None] < end) & (ks[None, :] < H - k0), other=0.0)
        w_mask = (ks[:, None] < H - k0) & (dims[None, :] < D)
        q = _dot(a, tl.load(wq + w_offs, mask=w_mask, other=0.0), q, IEEE)
        k = _dot(a, tl.load(wk + w_offs, mask=w_mask, other=0.0), k, IEEE)
        v = _dot(a, tl.load(wv + w_offs, mask=w_mask, other=0.0), v, IEEE)
        x_ptrs += BLOCK_K
        w_offs += BLOCK_K
    d_ok = dims < D
    q += tl.load(bq + dims, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    k += tl.load(bk + dims, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    v += tl.load(bv + dims, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    return q, k, v


@triton.jit
def _operand(v, dtype, IEEE: tl.constexpr):
    """An fp32 intermediate as the next product's operand: rounded to the input dtype (as the unfused path stores it)
    for tensor cores, kept in fp32 for IEEE products (fp32 inputs; bf16 under the interpreter, whose fp32 -> bf16
    conversion truncates instead of rounding to nearest)."""
    if IEEE:
        return v
    return v.to(dtype)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _attend(q, k, v, key, end, m, total, acc, qk_scale, dtype, BLOCK: tl.constexpr, IEEE: tl.constexpr):
    """One key block of online-softmax attention: the running max m, sum `total` and accumulator acc after the keys
    key .. key + BLOCK (those at or past `end` masked out)."""
    s = _dot(q, tl.trans(k), tl.zeros((BLOCK, BLOCK), dtype=tl.float32), IEEE) * qk_scale  # log2 units
    keys = key + tl.arange(0, BLOCK)
    s = tl.where(keys[None, :] < end, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    total = total * alpha + tl.sum(p, axis=1)
    # p in two halves of the input dtype (hi + lo): the product keeps p's fp32 precision, where rounding p once
    # (flash attention's habit) would cost more than the tolerance table allows
    if IEEE:
        acc = _dot(p, v, acc * alpha[:, None], IEEE)
    else:
        p_hi = p.to(dtype)
        acc = tl.dot(p_hi, v, acc * alpha[:, None])
        acc = tl.dot((p - p_hi.to(tl.float32)).to(dtype), v, acc)
    return m_new, total, acc


@triton.jit
def _store_out_projection(ctx, wo_ptr, p_ptr, rows, end, head, H, D, stride_wo,
                          BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """The head's share of the output projection, ctx [BLOCK, BLOCK_D] @ Wo[:, head*D : head*D + D]^T, stored as fp32
    rows of its [T, H] partial-sum slice p_ptr (rows past `end` not stored)."""
    dims = tl.arange(0, BLOCK_D)
    for n0 in range(0, H, BLOCK_N):
        ns = n0 + tl.arange(0, BLOCK_N)
        wo = tl.load(wo_ptr + ns[None, :].to(tl.int64) * stride_wo + (head * D + dims)[:, None],
                     mask=(dims[:, None] < D) & (ns[None, :] < H), other=0.0)  # [BLOCK_D, BLOCK_N] of Wo^T
        prod = _dot(ctx, wo, tl.zeros((BLOCK, BLOCK_N), dtype=tl.float32), IEEE)
        tl.store(p_ptr + rows[:, None].to(tl.int64) * H + ns[None, :], prod,
                 mask=(rows[:, None] < end) & (ns[None, :] < H))


@deferrable
@triton.jit(do_not_specialize=["T"])  # counts: see _common.autotune
def _qkv_attention_kernel(x_ptr, w_ptr, b_ptr, cu_ptr, y_ptr, wo_ptr, T, H, D, qk_scale, stride_x, stride_w,
                          stride_y, stride_wo,
                          BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                          OUT_PROJ: tl.constexpr, IEEE: tl.constexpr, USE_PDL: tl.constexpr = False):
    # OUT_PROJ: y is the [heads, T, H] fp32 partial sums of the output projection (head h's slice at h * T * H), not
    # the [T, H] context
    seq = tl.program_id(0)
    head = tl.program_id(1)
    part = tl.program_id(2)
    pdl_sync(USE_PDL)
    parts = tl.num_programs(2)
    filler = tl.num_programs(0) - 1  # the last grid row: zeros for the rows past the last offset
    dims = tl.arange(0, BLOCK_D)
    y_cols = head * D + dims
    start = tl.minimum(tl.maximum(tl.load(cu_ptr + seq).to(tl.int32), 0), T)
    dtype = x_ptr.dtype.element_ty
    p_ptr = y_ptr + head.to(tl.int64) * T * H  # OUT_PROJ: this head's partial-sum slice
    if seq == filler:
        for first in range(start + part * BLOCK, T, BLOCK * parts):
            rows = first + tl.arange(0, BLOCK)
            if OUT_PROJ:
                for n0 in range(0, H, BLOCK_N):
                    ns = n0 + tl.arange(0, BLOCK_N)
                    tl.store(p_ptr + rows[:, None].to(tl.int64) * H + ns[None, :],
                             tl.zeros((BLOCK, BLOCK_N), dtype=tl.float32), mask=(rows[:, None] < T) & (ns[None, :] < H))
            else:
                tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + y_cols[None, :],
                         tl.zeros((BLOCK, BLOCK_D), dtype=dtype), mask=(rows[:, None] < T) & (dims[None, :] < D))
    else:
        end = tl.minimum(tl.maximum(tl.load(cu_ptr + seq + 1).to(tl.int32), start), T)
        wq = w_ptr + (head * D).to(tl.int64) * stride_w
        wk = w_ptr + (H + head * D).to(tl.int64) * stride_w
        wv = w_ptr + (2 * H + head * D).to(tl.int64) * stride_w
        bq, bk, bv = b_ptr + head * D, b_ptr + H + head * D, b_ptr + 2 * H + head * D
        for first in range(start + part * BLOCK, end, BLOCK * parts):
            m = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
            total = tl.zeros((BLOCK,), dtype=tl.float32)
            acc = tl.zeros((BLOCK, BLOCK_D), dtype=tl.float32)
            if end - start <= BLOCK:  # the sequence fits one block: its queries are its keys, projected in one pass
                # (names of their own: a variable set in both branches must keep one type, and q, k, v below are
                # rounded operands where these are fp32 sums)
                q32, k32, v32 = _project_qkv(x_ptr, wq, wk, wv, bq, bk, bv, first, end, H, D, stride_x, stride_w,
                                             BLOCK, BLOCK_D, BLOCK_K, IEEE)
                m, total, acc = _attend(_operand(q32, dtype, IEEE), _operand(k32, dtype, IEEE),
                                        _operand(v32, dtype, IEEE), first, end, m, total, acc, qk_scale, dtype, BLOCK,
                                        IEEE)
            else:
                q = _operand(_project(x_ptr, wq, bq, first, end, H, D, stride_x, stride_w,
                                      BLOCK, BLOCK_D, BLOCK_K, IEEE), dtype, IEEE)
                for key in range(start, end, BLOCK):
                    k = _operand(_project(x_ptr, wk, bk, key, end, H, D, stride_x, stride_w,
                                          BLOCK, BLOCK_D, BLOCK_K, IEEE), dtype, IEEE)
                    v = _operand(_project(x_ptr, wv, bv, key, end, H, D, stride_x, stride_w,
                                          BLOCK, BLOCK_D, BLOCK_K, IEEE), dtype, IEEE)
                    m, total, acc = _attend(q, k, v, key, end, m, total, acc, qk_scale, dtype, BLOCK, IEEE)
            rows = first + tl.arange(0, BLOCK)
            ctx = acc / total[:, None]
            if OUT_PROJ:
                _store_out_projection(_operand(ctx, dtype, IEEE), wo_ptr, p_ptr, rows, end, head, H, D, stride_wo,
                                      BLOCK, BLOCK_D, BLOCK_N, IEEE)
            else:
                tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + y_cols[None, :], ctx.to(dtype),
                         mask=(rows[:, None] < end) & (dims[None, :] < D))


def launch_shape(max_seqlen: int, head_dim: int, hidden: int) -> dict:
    """BLOCK (query and key rows per step: the sequence bound rounded up to a power of two, 16..64), BLOCK_D, BLOCK_K
    and BLOCK_N (the projections' input and output column steps), the warps, and how many programs share one
    sequence's query blocks. Under the interpreter the steps are larger (its cost is per operation, not per element;
    the masks make any step size exact): the same results in a fraction of the test time."""
    wide = 512 if INTERPRET else 64
    block = min(max(triton.next_power_of_2(max(max_seqlen, 1)), 16), 128 if INTERPRET else 64)
    block_d = max(triton.next_power_of_2(head_dim), 16)
    step = min(max(triton.next_power_of_2(hidden), 16), wide)
    return {"BLOCK": block, "BLOCK_D": block_d, "BLOCK_K": step, "BLOCK_N": step,
            "num_warps": 4 if block * block_d <= 2048 else 8, "parts": triton.cdiv(min(max_seqlen, 4096), block)}


def _check(name: str, x: Tensor, weight: Tensor, bias: Tensor, num_heads: int) -> None:
    check_device(name, x, weight, bias)
    if x.dtype not in DTYPES or weight.dtype != x.dtype or bias.dtype != x.dtype:
        raise TypeError(f"{name}: x, weight and bias must share one of {DTYPES}, got "
                        f"{x.dtype}, {weight.dtype}, {bias.dtype}")
    if x.dim() != 2 or weight.shape != (3 * x.shape[1], x.shape[1]) or bias.shape != (3 * x.shape[1],):
        raise ValueError(f"{name}: x {tuple(x.shape)}, weight {tuple(weight.shape)} and bias "
                         f"{tuple(bias.shape)} do not fit x [T, H] @ weight [3H, H]^T + bias [3H]")
    if num_heads < 1 or x.shape[1] % num_heads:
        raise ValueError(f"{name}: {num_heads} heads do not split {x.shape[1]} columns")


def _launch(x: Tensor, weight: Tensor, bias: Tensor, cu_seqlens: Tensor, y: Tensor, max_seqlen: int, num_heads: int,
            out_weight: Tensor | None) -> None:
    t, hidden = x.shape
    d = hidden // num_heads
    shape = launch_shape(max_seqlen, d, hidden)
    parts = shape.pop("parts")
    ieee = x.dtype == torch.float32 or (INTERPRET and x.dtype == torch.bfloat16)  # the interpreter's bf16 dot
    wo = out_weight if out_weight is not None else weight
    _qkv_attention_kernel[(cu_seqlens.numel(), num_heads, parts)](
        x, weight, bias, cu_seqlens, y, wo, t, hidden, d, d**-0.5 * LOG2E, x.stride(0), weight.stride(0),
        y.stride(0) if out_weight is None else 0, wo.stride(0), OUT_PROJ=out_weight is not None, IEEE=ieee, **shape,
        **pdl_args(x))


def qkv_attention(x: Tensor, weight: Tensor, bias: Tensor, cu_seqlens: Tensor, max_seqlen: int, num_heads: int, *,
                  out: Tensor | None = None) -> Tensor:
    """softmax(q k^T / sqrt(d)) v per head within each packed sequence, q, k, v = x @ weight^T + bias: x [T, H] (unit
    column stride), weight [3H, H], bias [3H], cu_seqlens [B + 1] on x's device -> [T, H] in x's dtype, zeros past
    cu_seqlens[-1]; `out` (contiguous [T, H]) is written in place. Any sequence length is computed right;
    max_seqlen (a bound, as varlen attention takes it) sizes the blocks and the grid."""
    _check("qkv_attention", x, weight, bias, num_heads)
    if x.shape[1] // num_heads > MAX_HEAD_DIM:  # wider heads than the registers hold: the unfused torch path
        return reference.qkv_attention(x, weight, bias, cu_seqlens, max_seqlen, num_heads, out=out)
    x, weight, bias = x.contiguous(), weight.contiguous(), bias.contiguous()
    x, cu_seqlens, y = segment_arguments("qkv_attention", x, cu_seqlens, out, x.dtype, rows=x.shape[0])
    if y.numel():
        _launch(x, weight, bias, cu_seqlens, y, max_seqlen, num_heads, None)
    return y


def attention_partials(x: Tensor, weight: Tensor, bias: Tensor, cu_seqlens: Tensor, max_seqlen: int, num_heads: int,
                       out_weight: Tensor, *, out: Tensor | None = None) -> Tensor:
    """qkv_attention followed by each head's share of the output projection, ctx_h @ out_weight[:, h*d : h*d+d]^T,
    in the same kernel: [num_heads, T, H] fp32 partial sums (their sum is ctx @ out_weight^T; rows past the last
    offset: zeros), for partial_add_layer_norm to finish the block. out_weight [H, H] in nn.Linear's layout."""
    name = "attention_partials"
    _check(name, x, weight, bias, num_heads)
    t, hidden = x.shape
    if out_weight.shape != (hidden, hidden) or out_weight.dtype != x.dtype or out_weight.device != x.device:
        raise ValueError(f"{name}: out_weight must be [{hidden}, {hidden}] {x.dtype} on {x.device}, got "
                         f"{tuple(out_weight.shape)} {out_weight.dtype} on {out_weight.device}")
    shape = (num_heads, t, hidden)
    if out is not None and (out.shape != shape or out.dtype != torch.float32 or not out.is_contiguous()):
        raise ValueError(f"{name}: out must be a contiguous float32 tensor of shape {shape}")
    if hidden // num_heads > MAX_HEAD_DIM:
        return reference.attention_partials(x, weight, bias, cu_seqlens, max_seqlen, num_heads, out_weight, out=out)
    x, weight, bias, out_weight = x.contiguous(), weight.contiguous(), bias.contiguous(), out_weight.contiguous()
    cu_seqlens = offsets(name, x, cu_seqlens)
    y = out if out is not None else torch.empty(shape, dtype=torch.float32, device=x.device)
    if y.numel():
        _launch(x, weight, bias, cu_seqlens, y, max_seqlen, num_heads, out_weight)
    return y
