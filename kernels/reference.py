"""Plain torch implementations of every fused op: the oracle the fused backends are tested against,
and the fallback the registry uses when no fused backend is available or the fused path is off.

Math runs in float32 (float64 inputs stay float64, so the same code is the float64 ground truth in
tests); the result is cast back to the input dtype once. This module never imports Triton or CUDA code.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_SQRT_HALF = 1.0 / math.sqrt(2.0)
GLU_ACTIVATIONS = ("gelu", "silu")  # linear_glu's: exact-erf GELU (GeGLU), SiLU (SwiGLU)

def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _store(result: Tensor, dtype: torch.dtype, out: Tensor | None) -> Tensor:
    if out is None:
        return result.to(dtype)
    out.copy_(result)
    return out


def _gelu(h: Tensor, approximate: str) -> Tensor:
    # exact: 0.5 * h * (1 + erf(h / sqrt(2)))  (BERT); tanh: the GPT-2 approximation
    if approximate == "none":
        # written out rather than F.gelu: torch's fp32 CPU GELU returns NaN for +inf; one allocation
        return (h * _SQRT_HALF).erf_().add_(1.0).mul_(h).mul_(0.5)
    if approximate == "tanh":
        return torch.nn.functional.gelu(h, approximate="tanh")
    raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")


def _layer_norm(h: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    # (h - mean) / sqrt(var + eps) * weight + bias, biased variance over the last dimension; torch's
    # LayerNorm kernel accumulates in the input's precision (fp32 or fp64 here)
    return torch.nn.functional.layer_norm(h, h.shape[-1:], weight.to(h.dtype), bias.to(h.dtype), eps)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-12, *, out: Tensor | None = None) -> Tensor:
    h = x.to(_compute_dtype(x.dtype))
    return _store(_layer_norm(h, weight, bias, eps), x.dtype, out)


def layer_norm_gelu(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    eps: float = 1e-12,
    approximate: str = "none",
    *,
    out: Tensor | None = None,
) -> Tensor:
    h = x.to(_compute_dtype(x.dtype))
    return _store(_gelu(_layer_norm(h, weight, bias, eps), approximate), x.dtype, out)


def bias_gelu(x: Tensor, bias: Tensor, approximate: str = "none", *, out: Tensor | None = None) -> Tensor:
    h = x.to(_compute_dtype(x.dtype)) + bias
    return _store(_gelu(h, approximate), x.dtype, out)


def linear_bias_gelu(x: Tensor, weight: Tensor, bias: Tensor, approximate: str = "none", *,
                     out: Tensor | None = None) -> Tensor:
    """GELU(x @ weight^T + bias): a BERT layer's FFN-in. The GEMM runs in the input dtype (what cuBLAS does with
    fp32 accumulation on a GPU; float64 stays exact), then bias + GELU as bias_gelu."""
    return bias_gelu(torch.nn.functional.linear(x, weight), bias, approximate, out=out)


def bias_residual_gelu(
    x: Tensor,
    bias: Tensor,
    residual: Tensor,
    approximate: str = "none",
    *,
    out: Tensor | None = None,
) -> Tensor:
    # gelu(x + bias + residual)
    compute = _compute_dtype(x.dtype)
    h = x.to(compute) + bias + residual.to(compute)
    return _store(_gelu(h, approximate), x.dtype, out)


def add_layer_norm(
    x: Tensor,
    residual: Tensor,
    bias: Tensor | None,
    weight: Tensor,
    ln_bias: Tensor,
    eps: float = 1e-12,
    *,
    return_sum: bool = False,
    out: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    # s = x + bias + residual; y = LayerNorm(s). The pre-norm sum s is what pre-LN models carry forward.
    compute = _compute_dtype(x.dtype)
    s = x.to(compute) + residual.to(compute)
    if bias is not None:
        s = s + bias
    y = _store(_layer_norm(s, weight, ln_bias, eps), x.dtype, out)
    return (y, s.to(x.dtype)) if return_sum else y


def _rms_norm(h: Tensor, weight: Tensor, eps: float, dtype: torch.dtype) -> Tensor:
    # transformers' Qwen3RMSNorm / Qwen2RMSNorm: h * rsqrt(mean(h^2) + eps), rounded to the input dtype FIRST, then
    # times the weight (a product of two fp16/bf16 values is exact in fp32, so _store's one cast rounds it as a product
    # in the input dtype does); float64 rounds nothing
    n = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)
    return weight.to(h.dtype) * n.to(dtype).to(h.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, *, out: Tensor | None = None) -> Tensor:
    h = x.to(_compute_dtype(x.dtype))
    return _store(_rms_norm(h, weight, eps, x.dtype), x.dtype, out)


def add_rms_norm(
    x: Tensor,
    residual: Tensor,
    weight: Tensor,
    eps: float = 1e-6,
    *,
    return_sum: bool = False,
    out: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    # s = x + residual, rounded to x's dtype: the residual stream a pre-norm decoder carries forward, added in the
    # model dtype as transformers' decoder layers add it; y = rms_norm(s), of that rounded s (unlike add_layer_norm,
    # which normalizes the unrounded sum), so the fused op is exactly the unfused add then RMSNorm
    compute = _compute_dtype(x.dtype)
    s = (x.to(compute) + residual.to(compute)).to(x.dtype)
    y = rms_norm(s, weight, eps, out=out)
    return (y, s) if return_sum else y


def linear_add_layer_norm(x: Tensor, weight: Tensor, bias: Tensor, residual: Tensor, ln_weight: Tensor,
                          ln_bias: Tensor, eps: float = 1e-12, *, out: Tensor | None = None) -> Tensor:
    """LayerNorm(x @ weight^T + bias + residual): a BERT layer's attention-out or FFN-out block. The GEMM runs in the
    input dtype (as cuBLAS does on a GPU; float64 stays exact), then add_layer_norm."""
    return add_layer_norm(torch.nn.functional.linear(x, weight), residual, bias, ln_weight, ln_bias, eps, out=out)


def embedding_layer_norm(
    input_ids: Tensor,
    position_ids: Tensor,
    token_type_ids: Tensor,
    word_embeddings: Tensor,
    position_embeddings: Tensor,
    token_type_embeddings: Tensor,
    weight: Tensor,
    bias: Tensor,
    eps: float = 1e-12,
    *,
    out: Tensor | None = None,
) -> Tensor:
    # LayerNorm(word[input_ids] + position[position_ids] + token_type[token_type_ids]); ids: [tokens]
    compute = _compute_dtype(word_embeddings.dtype)
    h = (
        word_embeddings[input_ids].to(compute)
        + position_embeddings[position_ids].to(compute)
        + token_type_embeddings[token_type_ids].to(compute)
    )
    return _store(_layer_norm(h, weight, bias, eps), word_embeddings.dtype, out)


def _segments(cu_seqlens: Tensor, t: int, device) -> tuple[Tensor, Tensor]:
    """(the offsets clamped to [0, t] and made non-decreasing, each of t packed rows' segment: b where cu[b] <= row <
    cu[b + 1], or B, one past the last, for a row outside them: a packed batch's filler tokens)."""
    cu = torch.cummax(cu_seqlens.to(device=device, dtype=torch.long).clamp(0, t), 0).values
    rows = torch.arange(t, device=device)
    segment = torch.searchsorted(cu[1:], rows, right=True)
    return cu, torch.where(rows < cu[0], cu_seqlens.numel() - 1, segment)


def segment_mean(x: Tensor, cu_seqlens: Tensor, *, out: Tensor | None = None) -> Tensor:
    """Mean of each segment of rows: out[b] = mean(x[cu_seqlens[b] : cu_seqlens[b + 1]]) for x [T, H] and
    cu_seqlens [B + 1] (non-decreasing offsets, as varlen attention takes them) -> [B, H], float32 (float64 stays
    float64). An empty segment gives zeros; rows outside [cu_seqlens[0], cu_seqlens[B]) (a packed batch's filler
    tokens) add into a discarded scratch row only; offsets are clamped to [0, T]. The mean pooling of a packed batch
    (sentence-transformers' Pooling). No host synchronization: the fused-path-off model runs it inside CUDA graphs."""
    compute = _compute_dtype(x.dtype)
    t, segments = x.shape[0], cu_seqlens.numel() - 1
    cu, segment = _segments(cu_seqlens, t, x.device)
    sums = torch.zeros((segments + 1, x.shape[1]), dtype=compute, device=x.device)
    sums.index_add_(0, segment, x.to(compute))
    lengths = (cu[1:] - cu[:-1]).clamp(min=1)[:, None].to(compute)
    return _store(sums[:segments] / lengths, compute, out)


def splade_pool(x: Tensor, weight: Tensor, bias: Tensor | None, cu_seqlens: Tensor, *,
                out: Tensor | None = None) -> Tensor:
    """SPLADE pooling of a packed batch: out[b, v] = max over the rows t of segment b (cu_seqlens[b] <= t <
    cu_seqlens[b + 1]) of log1p(relu(x[t] @ weight[v] + bias[v])) for x [T, H] (the MLM head's transformed hidden
    states), weight [V, H] (nn.Linear's layout: the tied word embeddings), bias [V] or None and non-decreasing offsets
    cu_seqlens [B + 1] -> [B, V] float32 (float64 stays float64). An empty segment gives zeros; rows outside
    [cu_seqlens[0], cu_seqlens[B]) (a packed batch's filler tokens) reduce into a discarded scratch row only; offsets
    are clamped to [0, T]. log1p(relu(.)) is monotone, so the max is taken over the logits, into zeros (the relu),
    and the activation applied once. The GEMM runs in the input dtype (as cuBLAS does: the logits rounded to it, which
    the fused kernel does not do), the max is exact in any dtype, log1p runs in float32. The [T, V] logits are
    materialized. No host synchronization: it runs inside CUDA graphs."""
    compute = _compute_dtype(x.dtype)
    t, segments, vocab = x.shape[0], cu_seqlens.numel() - 1, weight.shape[0]
    cu, segment = _segments(cu_seqlens, t, x.device)
    # rows outside every segment enter the GEMM as zeros: whatever they hold cannot reach a segment's logits (oneDNN's
    # AMX bfloat16 matmul in torch 2.14.1's CPU build leaks a NaN row into another where K is not a multiple of 32,
    # uxlfoundation/oneDNN#5717)
    x = torch.where((segment < segments)[:, None], x, x.new_zeros(()))
    logits = torch.nn.functional.linear(x, weight, bias)  # [T, V] in x's dtype
    # max into zeros (include_self): max(0, max of the logits), the relu of the max; a NaN logit propagates
    peak = logits.new_zeros((segments + 1, vocab)).scatter_reduce_(0, segment[:, None].expand(t, vocab), logits,
                                                                   "amax")
    return _store(peak[:segments].to(compute).log1p_(), compute, out)


def m3_sparse(x: Tensor, weight: Tensor, bias: Tensor, ids: Tensor, cu_seqlens: Tensor, dropped: Tensor, *,
              out: Tensor | None = None) -> Tensor:
    """BGE-M3's sparse weights of a packed batch, per token: out[t] = w[t] = relu(x[t] . weight + bias) if token t is
    the representative of its (sequence, id) group and its id is not in `dropped`, else 0. The representative is the
    group's token of the largest weight, a NaN above every number, the lowest index among equals. So each sequence's
    nonzeros are FlagEmbedding's sparse dict (the largest weight per token id, the special ids dropped) without the
    [sequences, vocabulary] scatter of M3Embedder; a NaN weight is kept as its group's value (NaN, as the dense
    scatter's amax gives it), never dropped. x [T, H], weight [H] (sparse_linear's one row), bias [1], ids [T] and
    dropped [K] integer ids, non-decreasing offsets cu_seqlens [B + 1] -> [T] float32 (float64 stays float64).
    Tokens outside [cu_seqlens[0], cu_seqlens[B]) (a packed batch's filler tokens) and dropped ones give 0 and their
    rows enter the product as zeros; offsets are clamped to [0, T]. The weights are computed in float32 from the
    inputs' values. Exact ranking by stable sorts (weight, NaN first, then id, then sequence): no [T, T] or [B, V]
    buffer, no host synchronization (it runs inside CUDA graphs)."""
    compute = _compute_dtype(x.dtype)
    t, segments = x.shape[0], cu_seqlens.numel() - 1
    cu, segment = _segments(cu_seqlens, t, x.device)
    ids = ids.to(device=x.device, dtype=torch.long)
    dropped = dropped.to(device=x.device, dtype=torch.long)
    kept = (segment < segments) & ~(ids[:, None] == dropped[None, :]).any(dim=1)
    h = torch.where(kept[:, None], x, x.new_zeros(())).to(compute)
    w = torch.relu(h @ weight.to(compute) + bias.to(compute))  # [T]
    # a lexicographic order by stable sorts, the last sort the most significant key: (sequence, id) groups together,
    # within each NaN first, then the weight descending, then the index ascending (the order left by the earlier sorts)
    nan = torch.isnan(w)
    order = torch.sort(torch.where(nan, torch.inf, w), descending=True, stable=True).indices
    for key, descending in ((nan, True), (ids, False), (segment, False)):
        order = order[torch.sort(key[order].to(torch.long), descending=descending, stable=True).indices]
    group_ids, group_segments = ids[order], segment[order]
    first = torch.ones_like(kept)
    first[1:] = (group_ids[1:] != group_ids[:-1]) | (group_segments[1:] != group_segments[:-1])
    representative = torch.zeros_like(kept).scatter_(0, order, first)
    return _store(torch.where(representative & kept, w, w.new_zeros(())), compute, out)


def qkv_attention(x: Tensor, weight: Tensor, bias: Tensor, cu_seqlens: Tensor, max_seqlen: int, num_heads: int, *,
                  out: Tensor | None = None) -> Tensor:
    """Self-attention of each packed sequence with its QKV projection: qkv = x @ weight^T + bias for x [T, H] and
    weight [3H, H] (query, key and value rows stacked, each split into num_heads heads of H / num_heads), then per
    head softmax(q k^T / sqrt(H / num_heads)) v within each sequence cu_seqlens[b] : cu_seqlens[b + 1] -> [T, H] in
    x's dtype. Rows past cu_seqlens[-1] (a packed batch's filler tokens) come out as zeros. Sequences must be at
    most max_seqlen long. The projection runs in the input dtype (as cuBLAS does), attention in float32 (float64
    stays float64) through SDPA on a padded [batch, max_seqlen] block built on the device: no host sync, so it
    runs inside CUDA graphs."""
    compute = _compute_dtype(x.dtype)
    t, hidden = x.shape
    batch, d = cu_seqlens.numel() - 1, hidden // num_heads
    qkv = torch.nn.functional.linear(x, weight, bias).to(compute)
    cu = torch.cummax(cu_seqlens.to(device=x.device, dtype=torch.long).clamp(0, t), 0).values
    rows = torch.arange(t, device=x.device)
    seq = torch.searchsorted(cu[1:], rows, right=True).clamp(max=max(batch - 1, 0))
    real = (rows >= cu[0]) & (rows < cu[-1])
    pad_index = torch.where(real, seq * max_seqlen + rows - cu[seq], batch * max_seqlen)  # filler -> scratch row
    padded = qkv.new_zeros((batch * max_seqlen + 1, 3 * hidden)).index_copy_(0, pad_index, qkv)
    q, k, v = padded[:-1].view(batch, max_seqlen, 3, num_heads, d).permute(2, 0, 3, 1, 4)
    positions = torch.arange(max_seqlen, device=x.device)
    keep = (positions[None, :] < (cu[1:] - cu[:-1])[:, None])[:, None, None, :]
    ctx = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)  # [batch, heads, seq, d]
    return _store(_unpacked(ctx, pad_index, real), x.dtype, out)


def relative_attention(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, num_heads: int, bias: Tensor, *,
                       out: Tensor | None = None) -> Tensor:
    """Self-attention of each packed sequence with a relative position bias (MPNet's): per head h,
    softmax(q k^T / sqrt(d) + B[h, j - i]) v within each sequence cu_seqlens[b] : cu_seqlens[b + 1], for qkv [T, 3H]
    (query, key and value stacked along columns as qkv.view(T, 3, num_heads, d), d = H / num_heads) and the bias
    table bias [num_heads, 2R - 1] (key - query distance r at column r + R - 1) -> [T, H] in qkv's dtype. Rows
    outside cu_seqlens[0] : cu_seqlens[-1] (a packed batch's filler tokens) come out as zeros. Sequences must be at
    most max_seqlen <= R long. Computed in float32 (float64 stays float64) through SDPA on a padded [batch,
    max_seqlen] block built on the device, with the bias materialized for that block as SDPA's float mask [batch,
    heads, max_seqlen, max_seqlen] (the masked keys -inf; memory the fused kernel never spends): no host sync, so it
    runs inside CUDA graphs."""
    compute = _compute_dtype(qkv.dtype)
    t, width = qkv.shape
    hidden = width // 3
    batch, d = cu_seqlens.numel() - 1, hidden // num_heads
    reach = (bias.shape[1] + 1) // 2
    if max_seqlen > reach:
        raise ValueError(f"relative_attention: max_seqlen {max_seqlen} is past the bias table's reach {reach} "
                         f"(bias [{bias.shape[0]}, {bias.shape[1]}] covers distances up to {reach - 1})")
    if batch * max_seqlen == 0:  # no sequence (or none may hold a token): every row is filler
        return _store(qkv.new_zeros((t, hidden), dtype=compute), qkv.dtype, out)
    padded, pad_index, real, lengths = _packed_block(qkv, cu_seqlens, max_seqlen, compute)
    q, k, v = padded[:-1].view(batch, max_seqlen, 3, num_heads, d).permute(2, 0, 3, 1, 4)
    positions = torch.arange(max_seqlen, device=qkv.device)
    table = bias.to(compute)[:, positions[None, :] - positions[:, None] + reach - 1]  # [heads, seq(q), seq(k)]
    keys = positions[None, :] < lengths[:, None]  # [batch, seq(k)]
    mask = table[None].masked_fill(~keys[:, None, None, :], float("-inf"))  # [batch, heads, seq, seq]
    ctx = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [batch, heads, seq, d]
    return _store(_unpacked(ctx, pad_index, real), qkv.dtype, out)


def disentangled_attention(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, num_heads: int,
                           pos_key: Tensor | None, pos_query: Tensor | None, rows: Tensor, scale: float, *,
                           out: Tensor | None = None) -> Tensor:
    """Self-attention of each packed sequence with DeBERTa's disentangled relative attention: per head h,
    softmax(S * scale) v within each sequence cu_seqlens[b] : cu_seqlens[b + 1], S(i, j) = q_i . k_j + q_i . Pk[r]
    (c2p) + k_j . Pq[r] (p2c) with r = rows[i - j + R - 1] the table row of the query - key distance, for qkv [T, 3H]
    (qkv.view(T, 3, num_heads, d)), the relative table projected for each term, pos_key and pos_query [P, H] (heads
    along columns as qkv's; None: that term off) and rows [2R - 1] (entries in [0, P)) -> [T, H] in qkv's dtype. Rows
    outside cu_seqlens[0] : cu_seqlens[-1] come out as zeros. Sequences must be at most max_seqlen <= R long.
    Computed in float32 (float64 stays float64) on a padded [batch, max_seqlen] block built on the device, the way
    transformers computes it: q Pk^T and k Pq^T against the whole table, gathered per (query, key) pair into [batch,
    heads, max_seqlen, max_seqlen] (memory the fused kernel never spends); no host sync, so it runs inside CUDA
    graphs."""
    compute = _compute_dtype(qkv.dtype)
    t, width = qkv.shape
    hidden = width // 3
    batch, d = cu_seqlens.numel() - 1, hidden // num_heads
    reach = (rows.shape[0] + 1) // 2
    if max_seqlen > reach:
        raise ValueError(f"disentangled_attention: max_seqlen {max_seqlen} is past the row vector's reach {reach} "
                         f"(rows [{rows.shape[0]}] covers distances up to {reach - 1})")
    if batch * max_seqlen == 0:  # no sequence (or none may hold a token): every row is filler
        return _store(qkv.new_zeros((t, hidden), dtype=compute), qkv.dtype, out)
    padded, pad_index, real, lengths = _packed_block(qkv, cu_seqlens, max_seqlen, compute)
    q, k, v = padded[:-1].view(batch, max_seqlen, 3, num_heads, d).permute(2, 0, 3, 1, 4)  # [batch, heads, seq, d]
    positions = torch.arange(max_seqlen, device=qkv.device)
    index = rows.to(device=qkv.device, dtype=torch.long)[positions[:, None] - positions[None, :] + reach - 1]
    index = index.expand(batch, num_heads, max_seqlen, max_seqlen)  # [.., seq(q), seq(k)]: the row of i - j
    scores = q @ k.transpose(-1, -2)
    if pos_key is not None:  # c2p(i, j) = q_i . Pk[r(i - j)]
        table = pos_key.to(compute).view(-1, num_heads, d).transpose(0, 1)  # [heads, P, d]
        scores = scores + (q @ table.transpose(-1, -2)).gather(-1, index)
    if pos_query is not None:  # p2c(i, j) = k_j . Pq[r(i - j)]: gathered per key row, then turned to (query, key)
        table = pos_query.to(compute).view(-1, num_heads, d).transpose(0, 1)
        scores = scores + (k @ table.transpose(-1, -2)).gather(-1, index.transpose(-1, -2)).transpose(-1, -2)
    keys = positions[None, :] < lengths[:, None]  # [batch, seq(k)]
    scores = (scores * scale).masked_fill(~keys[:, None, None, :], float("-inf"))
    ctx = torch.softmax(scores, dim=-1) @ v  # [batch, heads, seq, d]; a sequence of no keys: NaN, never gathered
    return _store(_unpacked(ctx, pad_index, real), qkv.dtype, out)


def _unpacked(ctx: Tensor, pad_index: Tensor, real: Tensor) -> Tensor:
    """An attention's context on the padded block, [batch, heads, max_seqlen, d], back to the packed rows [T, heads x
    d] (_packed_block's pad_index), zeros for the filler rows."""
    batch, heads, seq, d = ctx.shape
    ctx = ctx.transpose(1, 2).reshape(batch * seq, heads * d)
    return torch.where(real[:, None], ctx[pad_index.clamp(max=max(batch * seq - 1, 0))], 0.0)


def _packed_block(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, compute: torch.dtype):
    """A packed batch's rows scattered into a padded [batch, max_seqlen] block on the device (no host sync): the
    block [batch * max_seqlen + 1, width] in `compute` (the last row a scratch row for filler tokens), each token's
    row in it, whether it is a real token, and each sequence's length."""
    t, width = qkv.shape
    batch = cu_seqlens.numel() - 1
    cu = torch.cummax(cu_seqlens.to(device=qkv.device, dtype=torch.long).clamp(0, t), 0).values
    rows = torch.arange(t, device=qkv.device)
    seq = torch.searchsorted(cu[1:], rows, right=True).clamp(max=max(batch - 1, 0))
    real = (rows >= cu[0]) & (rows < cu[-1])
    pad_index = torch.where(real, seq * max_seqlen + rows - cu[seq], batch * max_seqlen)  # filler -> scratch row
    padded = qkv.new_zeros((batch * max_seqlen + 1, width), dtype=compute).index_copy_(0, pad_index, qkv.to(compute))
    return padded, pad_index, real, cu[1:] - cu[:-1]


def rotate_half(x: Tensor, positions: Tensor, inv_freq: Tensor) -> Tensor:
    """Rotary embedding of x [..., S, d] at positions [S]: x cos + rotate_half(x) sin with the angles
    position * inv_freq repeated over both halves (transformers' apply_rotary_pos_emb; dimension i pairs with
    i + d/2), computed in x's dtype with the angles in float32 (float64 stays)."""
    precision = _compute_dtype(x.dtype)
    angles = positions[:, None].to(precision) * inv_freq.to(precision)[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    half = x.shape[-1] // 2
    return x * angles.cos().to(x.dtype) + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * angles.sin().to(x.dtype)


def rotary_attention(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, num_heads: int, inv_freq: Tensor,
                     window: int = 0, num_kv_heads: int | None = None, causal: bool = False,
                     q_norm: Tensor | None = None, k_norm: Tensor | None = None, norm_eps: float = 1e-6, *,
                     out: Tensor | None = None) -> Tensor:
    """Self-attention of each packed sequence with rotary position embeddings: per head, q and k rotated by their
    token's position within its sequence (0-based; rotate_half), then softmax(q k^T / sqrt(d)) v within each sequence
    cu_seqlens[b] : cu_seqlens[b + 1], for qkv [T, (H + 2 KV) d] (num_heads query heads, then num_kv_heads key and
    value heads, KV = num_heads unless given: grouped-query attention, query head h reading key/value head
    h // (H / KV); d even) and inv_freq [d / 2] -> [T, H d] in qkv's dtype. window > 0: a query attends only to keys
    at most `window` positions away (a sliding window of 2 * window + 1); causal: only to keys at or before it.
    q_norm, k_norm [d]: each head of q and k RMS-normed with them first (Qwen3's q_norm and k_norm, eps norm_eps).
    Rows past cu_seqlens[-1] come out as zeros. Computed in float32 (float64 stays) through SDPA on a padded
    [batch, max_seqlen] block built on the device: no host sync, so it runs inside CUDA graphs."""
    compute = _compute_dtype(qkv.dtype)
    t, width = qkv.shape
    batch, kv_heads = cu_seqlens.numel() - 1, num_kv_heads or num_heads
    d = width // (num_heads + 2 * kv_heads)
    if batch * max_seqlen == 0:
        return _store(qkv.new_zeros((t, num_heads * d), dtype=compute), qkv.dtype, out)
    padded, pad_index, real, lengths = _packed_block(qkv, cu_seqlens, max_seqlen, compute)
    q, k, v = padded[:-1].view(batch, max_seqlen, width).split([num_heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k, v = (x.reshape(batch, max_seqlen, -1, d).transpose(1, 2) for x in (q, k, v))  # [batch, heads, seq, d]
    if q_norm is not None:
        q, k = _rms_heads(q, q_norm, norm_eps), _rms_heads(k, k_norm, norm_eps)
    positions = torch.arange(max_seqlen, device=qkv.device)
    q, k = rotate_half(q, positions, inv_freq), rotate_half(k, positions, inv_freq)
    k, v = k.repeat_interleave(num_heads // kv_heads, dim=1), v.repeat_interleave(num_heads // kv_heads, dim=1)
    keep = (positions[None, :] < lengths[:, None])[:, None, None, :]  # [batch, 1, 1, seq(k)]
    distance = positions[None, :] - positions[:, None]  # key - query
    if window > 0:
        keep = keep & (distance.abs() <= window)[None, None]
    if causal:
        keep = keep & (distance <= 0)[None, None]
    ctx = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    return _store(_unpacked(ctx, pad_index, real), qkv.dtype, out)


def _rms_heads(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Each head's RMSNorm over its d columns (x [..., d], in x's compute dtype)."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.to(x.dtype)


def linear_glu(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str = "gelu", *,
               out: Tensor | None = None) -> Tensor:
    """A gated feed-forward's first half: act(x @ Wa^T + ba) * (x @ Wb^T + bb) for weight [2I, H] = [Wa; Wb] (the
    activated rows first) and bias [2I] or None -> [T, I] in x's dtype; act "gelu" (exact erf: GeGLU) or "silu"
    (SwiGLU). The GEMM runs in the input dtype (as cuBLAS does), the gate and product in float32."""
    if activation not in GLU_ACTIVATIONS:
        raise ValueError(f"linear_glu: activation {activation!r}; supported: {', '.join(GLU_ACTIVATIONS)}")
    compute = _compute_dtype(x.dtype)
    h = torch.nn.functional.linear(x, weight, bias).to(compute)
    a, b = h.chunk(2, dim=-1)
    a = _gelu(a, "none") if activation == "gelu" else torch.nn.functional.silu(a)
    return _store(a * b, x.dtype, out)


def attention_partials(x: Tensor, weight: Tensor, bias: Tensor, cu_seqlens: Tensor, max_seqlen: int, num_heads: int,
                       out_weight: Tensor, *, out: Tensor | None = None) -> Tensor:
    """Each head's share of a layer's attention output projection: ctx_h @ out_weight[:, h*d : h*d + d]^T for the
    context ctx = qkv_attention(...) (rounded to x's dtype, as stored) -> [num_heads, T, H] float32 (float64 stays);
    their sum over heads is ctx @ out_weight^T. Rows past cu_seqlens[-1]: zeros."""
    compute = _compute_dtype(x.dtype)
    t, hidden = x.shape
    ctx = qkv_attention(x, weight, bias, cu_seqlens, max_seqlen, num_heads).to(compute)
    parts = torch.einsum("thd,nhd->htn", ctx.view(t, num_heads, hidden // num_heads),
                         out_weight.to(compute).view(hidden, num_heads, hidden // num_heads))
    return _store(parts, compute, out)


def ffn_partials(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, splits: int, approximate: str = "none", *,
                 out: Tensor | None = None) -> Tensor:
    """A layer's feed-forward product GELU(x @ w1^T + b1) @ w2^T as `splits` partial sums over equal chunks of the
    intermediate width (the intermediate rounded to x's dtype, as stored) -> [splits, T, H] float32 (float64 stays)."""
    compute = _compute_dtype(x.dtype)
    h = linear_bias_gelu(x, w1, b1, approximate).to(compute)
    (t, inner), hidden = h.shape, w2.shape[0]
    parts = torch.einsum("tsc,nsc->stn", h.view(t, splits, inner // splits),
                         w2.to(compute).view(hidden, splits, inner // splits))
    return _store(parts, compute, out)


def partial_add_layer_norm(parts: Tensor, bias: Tensor | None, residual: Tensor, weight: Tensor, ln_bias: Tensor,
                           eps: float = 1e-12, *, out: Tensor | None = None) -> Tensor:
    """LayerNorm(parts.sum(0) + bias + residual) for a split GEMM's partial products parts [P, T, H] -> [T, H] in
    residual's dtype: what finishes attention_partials and ffn_partials."""
    compute = _compute_dtype(residual.dtype)
    s = parts.to(compute).sum(0) + residual.to(compute)
    if bias is not None:
        s = s + bias.to(compute)
    return _store(_layer_norm(s, weight, ln_bias, eps), residual.dtype, out)

