"""Kernel suite: each fused op beside the same computation written as plain PyTorch, eager and under torch.compile,
and per fused backend (triton, cuda), in one run, against the device's measured copy bandwidth.

Scenarios:
  fused-ops       the row-wise memory-bound ops (LayerNorm, GELU, their fusions, embedding + LayerNorm) x dtype x
                  shape: device time, GB/s of the fewest bytes the op must move, % of the copy ceiling, the error
                  against a float64 reference; on a GPU with both backends also what the registry's auto mode picks
  gemm-epilogues  the encoder's GEMM blocks (FFN-in GEMM + bias + GELU, FFN-out GEMM + bias + residual + LayerNorm)
                  at few and many tokens: device time and TFLOP/s per backend against eager and torch.compile
  attention       the attention ops with position information on packed batches: relative_attention (MPNet's
                  relative position bias) at MPNet-base's width, disentangled_attention (DeBERTa-v3's content-to-
                  position and position-to-content terms) at deberta-v3-base's and rotary_attention (rotary
                  embeddings, optionally a sliding window) at GTE-base's and ModernBERT-base's: device time and
                  TFLOP/s of the real (unpadded, in-window) attention against the padded SDPA that eager PyTorch and
                  torch.compile run (with a materialized bias; DeBERTa's terms gathered from q Pk^T and k Pq^T as
                  transformers does; with q and k rotated in the input dtype)
  decoder-ops     the decoder embedders' ops (Qwen3) at Qwen3-Embedding-0.6B's and -4B's widths: RMSNorm, add + RMSNorm
                  (the residual stream written too), q/k RMSNorm + RoPE (the rotation pass of rotary_attention) and
                  SwiGLU (the gate/up GEMM with silu(gate) * up in its epilogue), beside eager PyTorch as transformers
                  writes it, torch.compile and Liger-Kernel (an optional bench dependency: its rows are skipped where
                  it is not installed); summary: ours against the best of torch.compile and Liger per cell
  gemm-fp8        an encoder layer's four GEMMs (QKV, attention output, FFN in, FFN out) at MiniLM-L6's and
                  BERT-base's widths in fp16 (cuBLAS, bias in the GEMM) against FP8 E4M3 on the tensor cores
                  (torch._scaled_mm: weights quantized per output channel ahead, activations per token), the
                  activations' quantization timed apart and together: device time, TFLOP/s and the error against a
                  float64 reference; summary: each case's layer sum per provider (what an FP8 encoder would gain)
  splade          SPLADE pooling (splade_pool: the MLM head's vocab GEMM with each sequence's max of log1p(relu) in
                  its epilogue) at BERT's vocab and width: device time, TFLOP/s and the peak memory the call allocates,
                  against the unfused PyTorch that materializes the [tokens, vocab] logits, eager and torch.compile
  m3-sparse       BGE-M3's sparse weights (m3_sparse: relu(x . w + b) per token, kept where the token is the largest
                  of its (sequence, id), specials dropped; [tokens] out) at BGE-M3's width and vocabulary, on packed
                  varlen and long batches: device time, GB/s of the hidden states read and the peak memory the call
                  allocates, against FlagEmbedding's formulation (relu(linear), scatter_reduce amax into a zeroed
                  [sequences, 250,002] float32, specials zeroed), eager and torch.compile; each checked in the dense
                  form against the float64 reference

Time ("us"): on a GPU the device time of one call captured in a CUDA graph and replayed with the L2 flushed before
each replay (kernels.timing.device_us, median); "launch_us" is the same call launched from Python back to back
(kernels.timing.eager_us), host overhead included. On the CPU (Triton interpreter) both are host time.
GB/s counts every input element read once and every output element written once (embedding_layer_norm: the
gathered word rows, the id vectors and the output; its small position and token-type tables stay in cache).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench import results as store
from fusedserve.kernels import fp8, timing
from fusedserve.kernels.spec import OP_SPECS, ROWWISE_OPS
from fusedserve.kernels.testing import compare, float64_reference

SCENARIOS = ("fused-ops", "gemm-epilogues", "gemm-fp8", "attention", "decoder-ops", "splade", "m3-sparse")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SHAPES = ("4096x768", "32768x384", "32768x768", "16384x1024", "8192x4096")
# name: (op, tokens M, in features K, out features N) at MiniLM-L6 (hidden 384) and BERT-base (768) widths
GEMM_SHAPES = {
    "minilm ffn-in 16 tokens": ("linear_bias_gelu", 16, 384, 1536),
    "minilm ffn-in 4096 tokens": ("linear_bias_gelu", 4096, 384, 1536),
    "bert-base ffn-in 4096 tokens": ("linear_bias_gelu", 4096, 768, 3072),
    "minilm ffn-out 16 tokens": ("linear_add_layer_norm", 16, 1536, 384),
    "minilm ffn-out 4096 tokens": ("linear_add_layer_norm", 4096, 1536, 384),
    "bert-base ffn-out 4096 tokens": ("linear_add_layer_norm", 4096, 3072, 768),
    # GTE-base's gated FFN-in (N: the gated output's width; the GEMM is 2N wide, the gate and up halves)
    "gte-base glu-in 16 tokens": ("linear_glu", 16, 768, 3072),
    "gte-base glu-in 4096 tokens": ("linear_glu", 4096, 768, 3072),
    # the CPU test's (the interpreter runs every program of a grid one after another): not in the default set
    "tiny ffn-in 8 tokens": ("linear_bias_gelu", 8, 16, 64),
    "tiny ffn-out 8 tokens": ("linear_add_layer_norm", 8, 64, 16),
    "tiny glu-in 8 tokens": ("linear_glu", 8, 16, 64),
}
DEFAULT_GEMM_SHAPES = tuple(name for name in GEMM_SHAPES if not name.startswith("tiny"))
# name: (op, hidden, heads, sequences, longest, varlen, the op's own parameters); varlen: lengths uniform in
# 1..longest, else all `longest`, max_seqlen = longest either way. relative_attention's parameter is its bias table's
# reach R (MPNet-base: 12 heads of 64, a table over its 514 positions); disentangled_attention's are (position_buckets,
# max_relative_positions, positions) (deberta-v3-base: 12 heads of 64, 256 log buckets over its 512 positions, both
# terms); rotary_attention's are (rotary theta, window) (GTE-base: 12 heads of 64 at theta 160000; ModernBERT-base's
# local layers: theta 10000, 64 tokens either side)
ATTENTION_SHAPES = {
    "mpnet-base b32 s128": ("relative_attention", 768, 12, 32, 128, False, 514),
    "mpnet-base b128 varlen s512": ("relative_attention", 768, 12, 128, 512, True, 514),
    "deberta-v3-base b32 s128": ("disentangled_attention", 768, 12, 32, 128, False, (256, 512, 512)),
    "deberta-v3-base b128 varlen s512": ("disentangled_attention", 768, 12, 128, 512, True, (256, 512, 512)),
    "gte-base b32 s128": ("rotary_attention", 768, 12, 32, 128, False, (160000.0, 0)),
    "gte-base b128 varlen s512": ("rotary_attention", 768, 12, 128, 512, True, (160000.0, 0)),
    "modernbert-base local b16 s1024": ("rotary_attention", 768, 12, 16, 1024, False, (10000.0, 64)),
    # the CPU test's: not in the default set
    "tiny b3 varlen s16": ("relative_attention", 32, 2, 3, 16, True, 18),
    "tiny deberta b3 varlen s40": ("disentangled_attention", 32, 2, 3, 40, True, (16, 24, 48)),
    "tiny rotary b3 varlen s16": ("rotary_attention", 32, 2, 3, 16, True, (10000.0, 0)),
    "tiny local b2 s40": ("rotary_attention", 32, 2, 2, 40, False, (10000.0, 4)),
}
DEFAULT_ATTENTION_SHAPES = tuple(name for name in ATTENTION_SHAPES if not name.startswith("tiny"))
# name: (sequences, tokens each, hidden H, vocab V): SPLADE on BERT-base's MLM head (naver/splade's models) at a large
# batch (16384 tokens: the [T, V] fp16 logits alone are 1 GB) and a small one
SPLADE_SHAPES = {
    "bert-base b64 s256": (64, 256, 768, 30522),
    "bert-base b8 s128": (8, 128, 768, 30522),
    # the CPU test's: not in the default set
    "tiny b3 s5": (3, 5, 16, 70),
}
DEFAULT_SPLADE_SHAPES = tuple(name for name in SPLADE_SHAPES if not name.startswith("tiny"))
# name: (sequences, tokens each (varlen: the longest, lengths uniform in 1..it), varlen, hidden H, vocabulary V):
# BGE-M3 (XLM-RoBERTa-large's width and vocabulary) on a packed batch of short inputs and on its 8192-token inputs
M3_SPARSE_SHAPES = {
    "bge-m3 b64 varlen s256": (64, 256, True, 1024, 250002),
    "bge-m3 b8 s8192": (8, 8192, False, 1024, 250002),
    "bge-m3 b1 s8192": (1, 8192, False, 1024, 250002),
    # the CPU test's: not in the default set
    "tiny b3 varlen s9": (3, 9, True, 16, 70),
}
DEFAULT_M3_SPARSE_SHAPES = tuple(name for name in M3_SPARSE_SHAPES if not name.startswith("tiny"))
M3_SPECIALS = (0, 1, 2, 3)  # XLM-R's <s>, <pad>, </s>, <unk>: the ids M3Embedder drops
# name: (tokens T, hidden, query heads H, key/value heads KV, head dim d, FFN intermediate I): Qwen3-Embedding-0.6B's
# and -4B's widths, at a batch of 4096 tokens and one of 32768; sequences of 512 tokens (the tiny case's: 8)
DECODER_SHAPES = {
    "0.6b 4096 tokens": (4096, 1024, 16, 8, 128, 3072),
    "0.6b 32768 tokens": (32768, 1024, 16, 8, 128, 3072),
    "4b 4096 tokens": (4096, 2560, 32, 8, 128, 9728),
    "4b 32768 tokens": (32768, 2560, 32, 8, 128, 9728),
    "tiny 24 tokens": (24, 64, 4, 2, 16, 96),  # the CPU test's: not in the default set
}
DEFAULT_DECODER_SHAPES = tuple(name for name in DECODER_SHAPES if not name.startswith("tiny"))
DECODER_OPS = ("rms_norm", "add_rms_norm", "qk_norm_rope", "swiglu")
DECODER_PROVIDERS = ("ours", "eager", "compile", "liger")
ROPE_THETA, RMS_EPS = 1_000_000.0, 1e-6
PROVIDERS = ("triton", "cuda", "eager", "compile")
AUTO_WIDTHS = (384, 768)  # MiniLM-L6's and BERT-base's hidden sizes
EPS = 1e-5
DEVICE_ROUNDS = 100  # graph replays per cell (each with the L2 flushed): the median of these is the cell's time


def _padded_block(qkv, cu_seqlens, max_seqlen: int):
    """A packed batch's rows gathered into a padded [batch, max_seqlen] block (padding: zero rows), what scatters
    the context back (each token's slot; filler tokens: a zero row past the block) and each sequence's length. Pure
    gathers, no host sync: a CUDA-graph captured forward and torch.compile (whose inductor cannot lower a view of
    an index_copy_ target) both take it."""
    t, width = qkv.shape
    batch = cu_seqlens.numel() - 1
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    positions = torch.arange(max_seqlen, device=qkv.device)
    rows = cu[:-1, None] + positions[None, :]  # [batch, max_seqlen]: each slot's token, or t (a zero row)
    rows = torch.where(positions[None, :] < lengths[:, None], rows, t).reshape(-1)
    block = torch.cat([qkv, qkv.new_zeros((1, width))])[rows]
    tokens = torch.arange(t, device=qkv.device)
    # over the whole of cu, not cu[1:]: inductor (torch 2.11) cannot lower searchsorted on a slice (SliceView)
    seq = (torch.searchsorted(cu, tokens, right=True) - 1).clamp(0, batch - 1)
    slot = torch.where(tokens < cu[-1], seq * max_seqlen + tokens - cu[seq], batch * max_seqlen)
    return block, slot, lengths, positions


def _heads(block, batch: int, max_seqlen: int, num_heads: int):
    """q, k and v [batch, heads, max_seqlen, d] of a padded block."""
    hidden = block.shape[1] // 3
    return block.view(batch, max_seqlen, 3, num_heads, hidden // num_heads).permute(2, 0, 3, 1, 4)


def padded_relative_attention(qkv, cu_seqlens, max_seqlen: int, num_heads: int, bias):
    """relative_attention as transformers computes it, from the packed batch: the rows padded into a [batch,
    max_seqlen] block, the bias materialized for it as [batch, heads, max_seqlen, max_seqlen] with the padded keys at
    -inf, SDPA in the input dtype, the real rows gathered back (filler rows: zeros)."""
    batch, hidden = cu_seqlens.numel() - 1, qkv.shape[1] // 3
    block, slot, lengths, positions = _padded_block(qkv, cu_seqlens, max_seqlen)
    q, k, v = _heads(block, batch, max_seqlen, num_heads)
    reach = (bias.shape[1] + 1) // 2
    padding = positions[None, :] >= lengths[:, None]  # [batch, keys]
    mask = bias.to(qkv.dtype)[:, positions[None, :] - positions[:, None] + reach - 1][None].masked_fill(
        padding[:, None, None, :], float("-inf"))
    ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(batch * max_seqlen, hidden)
    return torch.cat([ctx, ctx.new_zeros((1, hidden))])[slot]


def padded_disentangled_attention(qkv, cu_seqlens, max_seqlen: int, num_heads: int, pos_key, pos_query, rows,
                                  scale: float):
    """disentangled_attention as transformers computes it (DebertaV2's DisentangledSelfAttention), from the packed
    batch: the rows padded into a [batch, max_seqlen] block, q Pk^T and k Pq^T against the whole table
    ([batch, heads, max_seqlen, 2 span] each) gathered per pair by the row of its distance, their sum scaled as the
    mask of SDPA with the padded keys at -inf, all in the input dtype, the real rows gathered back (filler rows:
    zeros)."""
    batch, hidden = cu_seqlens.numel() - 1, qkv.shape[1] // 3
    block, slot, lengths, positions = _padded_block(qkv, cu_seqlens, max_seqlen)
    q, k, v = _heads(block, batch, max_seqlen, num_heads)
    reach, d = (rows.shape[0] + 1) // 2, hidden // num_heads
    index = rows[positions[:, None] - positions[None, :] + reach - 1].expand(batch, num_heads, max_seqlen, max_seqlen)
    bias = q.new_zeros(())
    if pos_key is not None:  # c2p(i, j) = q_i . Pk[r(i - j)]
        bias = bias + (q @ pos_key.view(-1, num_heads, d).permute(1, 2, 0)).gather(-1, index)
    if pos_query is not None:  # p2c(i, j) = k_j . Pq[r(i - j)]
        p2c = (k @ pos_query.view(-1, num_heads, d).permute(1, 2, 0)).gather(-1, index.transpose(-1, -2))
        bias = bias + p2c.transpose(-1, -2)
    padding = positions[None, :] >= lengths[:, None]  # [batch, keys]
    mask = (bias * scale).expand(batch, num_heads, max_seqlen, max_seqlen).masked_fill(
        padding[:, None, None, :], float("-inf"))
    ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    ctx = ctx.transpose(1, 2).reshape(batch * max_seqlen, hidden)
    return torch.cat([ctx, ctx.new_zeros((1, hidden))])[slot]


def padded_rotary_attention(qkv, cu_seqlens, max_seqlen: int, num_heads: int, inv_freq, window: int = 0):
    """rotary_attention as transformers computes it (GTE, ModernBERT), from the packed batch: the rows padded into a
    [batch, max_seqlen] block, q and k rotated there in the input dtype (cos and sin of the fp32 angles cast to it,
    apply_rotary_pos_emb), SDPA with the padded keys (and, with a window, the keys farther than it) masked out, the
    real rows gathered back (filler rows: zeros)."""
    batch, hidden = cu_seqlens.numel() - 1, qkv.shape[1] // 3
    block, slot, lengths, positions = _padded_block(qkv, cu_seqlens, max_seqlen)
    q, k, v = _heads(block, batch, max_seqlen, num_heads)
    angles = positions[:, None].float() * inv_freq.float()[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(qkv.dtype), angles.sin().to(qkv.dtype)
    half = q.shape[-1] // 2
    q, k = ((x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin) for x in (q, k))
    keep = (positions[None, :] < lengths[:, None])[:, None, None, :]  # [batch, 1, 1, keys]
    if window > 0:
        keep = keep & ((positions[None, :] - positions[:, None]).abs() <= window)
    ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(batch * max_seqlen, hidden)
    return torch.cat([ctx, ctx.new_zeros((1, hidden))])[slot]


def unfused_splade_pool(x, weight, bias, cu_seqlens):
    """SPLADE pooling as PyTorch writes it on the packed batch: the [T, V] logits in the input dtype, log1p(relu) of
    them (another [T, V]), then each sequence's max by a scatter-reduce into a zeroed [B + 1, V] (the filler tokens
    into the last row), float32 out. No host sync: a CUDA graph and torch.compile take it."""
    t, batch = x.shape[0], cu_seqlens.numel() - 1
    activations = torch.log1p(torch.relu(F.linear(x, weight, bias)))
    cu = cu_seqlens.long()
    tokens = torch.arange(t, device=x.device)
    # over the whole of cu, not cu[1:]: inductor (torch 2.11) cannot lower searchsorted on a slice (SliceView)
    seq = torch.searchsorted(cu, tokens, right=True) - 1
    seq = torch.where((tokens >= cu[0]) & (tokens < cu[-1]), seq, batch)
    peak = activations.new_zeros((batch + 1, activations.shape[1])).scatter_reduce_(
        0, seq[:, None].expand_as(activations), activations, "amax")
    return peak[:batch].float()


def dense_m3_sparse(x, weight, bias, ids, cu_seqlens, dropped, *, vocab: int):
    """BGE-M3's sparse output as FlagEmbedding's M3Embedder (and M3Head.sparse) computes it on the packed batch:
    relu(linear) per token in the input dtype, each sequence's largest weight per token id by a scatter_reduce amax
    into a zeroed [B + 1, vocab] float32 (the filler tokens into the last row), the dropped ids' columns zeroed ->
    [B, vocab] float32. No host sync: a CUDA graph and torch.compile take it."""
    t, batch = x.shape[0], cu_seqlens.numel() - 1
    weights = torch.relu(F.linear(x, weight[None], bias.to(x.dtype))).squeeze(-1).float()
    cu = cu_seqlens.long()
    tokens = torch.arange(t, device=x.device)
    # over the whole of cu, not cu[1:]: inductor (torch 2.11) cannot lower searchsorted on a slice (SliceView)
    seq = torch.searchsorted(cu, tokens, right=True) - 1
    seq = torch.where((tokens >= cu[0]) & (tokens < cu[-1]), seq, batch)
    out = weights.new_zeros((batch + 1) * vocab).scatter_reduce_(0, seq * vocab + ids.long(), weights, "amax")
    return out.view(batch + 1, vocab)[:batch].index_fill_(1, dropped.long(), 0.0)


def per_token_dense(values, ids, cu_seqlens, vocab: int):
    """A per-token output of m3_sparse (at most one nonzero per sequence and id) as the dense [B, vocab] of
    dense_m3_sparse, in its dtype: for the accuracy check, outside the timing."""
    t, batch = values.shape[0], cu_seqlens.numel() - 1
    cu = cu_seqlens.long()
    tokens = torch.arange(t, device=values.device)
    seq = torch.searchsorted(cu, tokens, right=True) - 1
    seq = torch.where((tokens >= cu[0]) & (tokens < cu[-1]), seq, batch)
    out = values.new_zeros((batch + 1) * vocab).scatter_reduce_(0, seq * vocab + ids.long(), values, "amax")
    return out.view(batch + 1, vocab)[:batch]


def _glu(h, activation: str):
    gate, up = h.chunk(2, dim=-1)
    return (F.gelu(gate) if activation == "gelu" else F.silu(gate)) * up


# The unfused PyTorch a user would write, in the input dtype: the eager and torch.compile providers.
UNFUSED: dict[str, Callable] = {
    "layer_norm": lambda x, w, b, eps: F.layer_norm(x, x.shape[-1:], w, b, eps),
    "layer_norm_gelu": lambda x, w, b, eps: F.gelu(F.layer_norm(x, x.shape[-1:], w, b, eps)),
    "bias_gelu": lambda x, bias: F.gelu(x + bias),
    "bias_residual_gelu": lambda x, bias, r: F.gelu(x + bias + r),
    "add_layer_norm": lambda x, r, bias, w, b, eps: F.layer_norm(x + bias + r, x.shape[-1:], w, b, eps),
    "embedding_layer_norm": lambda ids, pos, tt, word, position, ttype, w, b, eps: F.layer_norm(
        word[ids] + position[pos] + ttype[tt], word.shape[-1:], w, b, eps),
    "linear_bias_gelu": lambda x, w, b: F.gelu(F.linear(x, w, b)),
    "linear_add_layer_norm": lambda x, w, bias, r, g, b, eps: F.layer_norm(F.linear(x, w, bias) + r, r.shape[-1:],
                                                                           g, b, eps),
    "linear_glu": lambda x, w, b, activation: _glu(F.linear(x, w, b), activation),
    "relative_attention": padded_relative_attention,
    "disentangled_attention": padded_disentangled_attention,
    "rotary_attention": padded_rotary_attention,
    "splade_pool": unfused_splade_pool,
}


# ---- decoder-ops: transformers' Qwen3 code as a user runs it, and the same through Liger-Kernel ----------------------
def _qwen_rms(x, w, eps):
    # Qwen3RMSNorm: normed in float32 (float64 stays: the accuracy reference), rounded to x's dtype, then scaled
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _qwen_add_rms(x, r, w, eps):
    s = x + r  # the decoder layer's residual add, in the model dtype
    return _qwen_rms(s, w, eps), s


def _rope_tables(seq: int, inv_freq, dtype):
    # Qwen3RotaryEmbedding: float32 angles, cos and sin cast to the model dtype
    angles = torch.arange(seq, device=inv_freq.device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _qwen_qk_norm_rope(qkv, seq: int, heads: int, kv_heads: int, inv_freq, q_norm, k_norm, eps):
    """Qwen3Attention's q/k path on a batch of equal sequences: per-head norms, apply_rotary_pos_emb -> [T, (H + KV) d]
    (the layout the fused pass writes)."""
    t, d = qkv.shape[0], q_norm.shape[0]
    q = _qwen_rms(qkv[:, : heads * d].view(t // seq, seq, heads, d), q_norm, eps)
    k = _qwen_rms(qkv[:, heads * d: (heads + kv_heads) * d].view(t // seq, seq, kv_heads, d), k_norm, eps)
    cos, sin = (c[None, :, None, :] for c in _rope_tables(seq, inv_freq, qkv.dtype))

    def rotate(x):
        return x * cos + torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1) * sin
    return torch.cat((rotate(q).reshape(t, -1), rotate(k).reshape(t, -1)), dim=1)


DECODER_UNFUSED: dict[str, Callable] = {"rms_norm": _qwen_rms, "add_rms_norm": _qwen_add_rms,
                                        "qk_norm_rope": _qwen_qk_norm_rope,
                                        "swiglu": lambda x, w: _glu(F.linear(x, w), "silu")}


def _liger_ops() -> dict[str, Callable]:
    """The decoder ops as Liger-Kernel's Qwen3 patches run them (LigerRMSNorm in the llama casting mode, the fused add
    + RMSNorm, liger_rotary_pos_emb on q and k in their [batch, heads, seq, d] views, LigerSwiGLUMLP's two
    projections and silu-mul); ImportError where it is not installed. Outputs in Liger's own layouts."""
    from liger_kernel.transformers.functional import liger_fused_add_rms_norm, liger_rms_norm, liger_rope, liger_swiglu

    def qk_norm_rope(qkv, seq, heads, kv_heads, inv_freq, q_norm, k_norm, eps):
        t, d = qkv.shape[0], q_norm.shape[0]
        q = liger_rms_norm(qkv[:, : heads * d].reshape(t // seq, seq, heads, d), q_norm, eps, in_place=False)
        k = liger_rms_norm(qkv[:, heads * d: (heads + kv_heads) * d].reshape(t // seq, seq, kv_heads, d), k_norm,
                           eps, in_place=False)
        cos, sin = _rope_tables(seq, inv_freq, qkv.dtype)
        return liger_rope(q.transpose(1, 2), k.transpose(1, 2), cos[None], sin[None])

    def swiglu(x, w):
        half = w.shape[0] // 2
        return liger_swiglu(F.linear(x, w[:half]), F.linear(x, w[half:]))

    return {"rms_norm": lambda x, w, eps: liger_rms_norm(x, w, eps, in_place=False),
            "add_rms_norm": lambda x, r, w, eps: liger_fused_add_rms_norm(x, r, w, eps, in_place=False),
            "qk_norm_rope": qk_norm_rope, "swiglu": swiglu}


def _ours(op: str) -> Callable:
    from fusedserve.kernels.triton import LAUNCHERS
    from fusedserve.kernels.triton.rotary_attention import rotate_qk

    if op == "rms_norm":
        return LAUNCHERS["rms_norm"]
    if op == "add_rms_norm":
        return lambda x, r, w, eps: LAUNCHERS["add_rms_norm"](x, r, w, eps, return_sum=True)
    if op == "swiglu":
        return lambda x, w: LAUNCHERS["linear_glu"](x, w, None, "silu")

    def qk_norm_rope(qkv, seq, heads, kv_heads, inv_freq, q_norm, k_norm, eps):
        cu = torch.arange(0, qkv.shape[0] + 1, seq, dtype=torch.int32, device=qkv.device)
        return rotate_qk(qkv, cu, seq, heads, inv_freq, kv_heads, q_norm, k_norm, eps)
    return qk_norm_rope


def _as_rows(op: str, out, shape: tuple) -> torch.Tensor:
    """A provider's output in the fused op's layout, for the accuracy check (outside the timing)."""
    if op == "add_rms_norm":
        return out[0]
    if op == "qk_norm_rope" and isinstance(out, tuple):  # Liger's q, k [batch, heads, seq, d]
        t = shape[0]
        return torch.cat([x.transpose(1, 2).reshape(t, -1) for x in out], dim=1)
    return out


def decoder_inputs(op: str, name: str, dtype: torch.dtype, device: str, seed: int) -> tuple:
    t, hidden, heads, kv_heads, d, inner = DECODER_SHAPES[name]
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen) * scale + shift).to(device, dtype)

    if op == "rms_norm":
        return (randn(t, hidden), randn(hidden, scale=0.1, shift=1.0), RMS_EPS)
    if op == "add_rms_norm":
        return (randn(t, hidden), randn(t, hidden, scale=2.0), randn(hidden, scale=0.1, shift=1.0), RMS_EPS)
    if op == "swiglu":
        return (randn(t, hidden), randn(2 * inner, hidden, scale=hidden**-0.5))
    inv_freq = (1.0 / ROPE_THETA ** (torch.arange(0, d, 2, dtype=torch.float32) / d)).to(device)
    return (randn(t, (heads + 2 * kv_heads) * d), min(t, 8 if name.startswith("tiny") else 512), heads, kv_heads,
            inv_freq, randn(d, scale=0.1, shift=1.0), randn(d, scale=0.1, shift=1.0), RMS_EPS)


def decoder_cost(op: str, name: str, dtype: torch.dtype) -> tuple[int, int]:
    """(the fewest bytes the op moves: each input read once, each output written once; its GEMM FLOPs, or 0)."""
    t, hidden, heads, kv_heads, d, inner = DECODER_SHAPES[name]
    size = torch.finfo(dtype).bits // 8
    if op == "rms_norm":
        return 2 * t * hidden * size, 0
    if op == "add_rms_norm":  # x and the residual read, the normed rows and the sum written
        return 4 * t * hidden * size, 0
    if op == "qk_norm_rope":
        return 2 * t * (heads + kv_heads) * d * size, 0
    return (t * hidden + 2 * inner * hidden + t * inner) * size, 2 * t * hidden * 2 * inner


def rowwise_inputs(op: str, rows: int, cols: int, dtype: torch.dtype, device: str, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    if op == "embedding_layer_norm":  # real-sized tables: BERT's vocabulary, 512 positions, 2 token types
        ids = torch.randint(0, 30522, (rows,), generator=gen).to(device)
        pos = torch.randint(0, 512, (rows,), generator=gen).to(device)
        types = torch.randint(0, 2, (rows,), generator=gen).to(device)
        tables = [torch.randn(n, cols, generator=gen).to(device, dtype) for n in (30522, 512, 2)]
        w, b = (torch.randn(cols, generator=gen).to(device, dtype) for _ in range(2))
        return (ids, pos, types, *tables, w, b, EPS)
    args, _ = OP_SPECS[op].make_inputs(rows, cols, dtype, device, gen)
    return args


def gemm_inputs(op: str, m: int, k: int, n: int, dtype: torch.dtype, device: str, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen) * scale + shift).to(device, dtype)

    if op == "linear_glu":  # GTE's: no bias, GELU gate
        return (randn(m, k), randn(2 * n, k, scale=k**-0.5), None, "gelu")
    x, w, bias = randn(m, k), randn(n, k, scale=k**-0.5), randn(n, scale=0.5)
    if op == "linear_bias_gelu":
        return (x, w, bias)
    return (x, w, bias, randn(m, n, scale=2.0), randn(n, scale=0.5, shift=1.0), randn(n, scale=0.5), EPS)


def attention_inputs(name: str, dtype: torch.dtype, device: str, seed: int) -> tuple:
    """The op's arguments for an attention case: (qkv, cu_seqlens, max_seqlen, heads, bias) for relative_attention,
    (qkv, cu_seqlens, max_seqlen, heads, pos_key, pos_query, rows, scale) for disentangled_attention, (qkv, cu_seqlens,
    max_seqlen, heads, inv_freq, window) for rotary_attention; q, k, v, the bias and the projected tables of order 1,
    as the kernel tests draw them, DeBERTa's rows per distance (model.deberta_v2.relative_rows) and scale
    1 / sqrt(3 d), transformers' default rotary frequencies (float32) at the case's theta."""
    op, hidden, heads, sequences, longest, varlen, parameters = ATTENTION_SHAPES[name]
    gen = torch.Generator().manual_seed(seed)
    lengths = (torch.randint(1, longest + 1, (sequences,), generator=gen) if varlen
               else torch.full((sequences,), longest))
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)]).to(device)
    qkv = torch.randn(int(lengths.sum()), 3 * hidden, generator=gen).to(device, dtype)
    if op == "relative_attention":
        bias = torch.randn(heads, 2 * parameters - 1, generator=gen).to(device)
        return (qkv, cu, longest, heads, bias)
    if op == "disentangled_attention":
        from fusedserve.model.deberta_v2 import Disentangled, relative_rows

        buckets, max_relative, positions = parameters
        section = Disentangled(relative_attention=True, terms=("c2p", "p2c"), span=buckets, buckets=buckets,
                               max_relative_positions=max_relative)
        pos_key, pos_query = (torch.randn(2 * buckets, hidden, generator=gen).to(device, dtype) for _ in range(2))
        rows = relative_rows(positions, section).to(device)
        return (qkv, cu, longest, heads, pos_key, pos_query, rows, (3 * hidden // heads) ** -0.5)
    theta, window = parameters
    d = hidden // heads
    inv_freq = (1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)).to(device)
    return (qkv, cu, longest, heads, inv_freq, window)


def splade_inputs(name: str, dtype: torch.dtype, device: str, seed: int) -> tuple:
    """splade_pool's arguments for a case: (x, weight, bias, cu_seqlens) with x of order 1 (the MLM head's
    LayerNormed states), weight at 1/sqrt(H) and a bias shifted down (logits ~ N(-0.5, 1.25), as the kernel tests
    draw them), every sequence the case's length."""
    sequences, length, hidden, vocab = SPLADE_SHAPES[name]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sequences * length, hidden, generator=gen).to(device, dtype)
    weight = (torch.randn(vocab, hidden, generator=gen) * hidden**-0.5).to(device, dtype)
    bias = (torch.randn(vocab, generator=gen) * 0.5 - 0.5).to(device, dtype)
    cu = torch.arange(0, sequences * length + 1, length, dtype=torch.int32).to(device)
    return (x, weight, bias, cu)


def m3_sparse_inputs(name: str, dtype: torch.dtype, device: str, seed: int) -> tuple:
    """m3_sparse's arguments for a case: (x, weight, bias, ids, cu_seqlens, dropped) with x of order 1 (the encoder's
    LayerNormed last states), weight at 1/sqrt(H) and a float32 bias shifted down (about a third of the weights are
    relu's 0); token ids drawn for a text's repeats (two in five from 2,000 frequent ids, the others from the whole
    vocabulary), each sequence between CLS (0) and EOS (2); XLM-R's four special ids dropped."""
    sequences, longest, varlen, hidden, vocab = M3_SPARSE_SHAPES[name]
    gen = torch.Generator().manual_seed(seed)
    lengths = (torch.randint(1, longest + 1, (sequences,), generator=gen) if varlen
               else torch.full((sequences,), longest))
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
    t = int(lengths.sum())
    x = torch.randn(t, hidden, generator=gen)
    weight = torch.randn(hidden, generator=gen) * hidden**-0.5
    bias = torch.randn(1, generator=gen) * 0.25 - 0.5
    frequent = torch.randint(4, vocab, (min(2000, vocab),), generator=gen)
    ids = torch.where(torch.rand(t, generator=gen) < 0.4,
                      frequent[torch.randint(0, frequent.numel(), (t,), generator=gen)],
                      torch.randint(4, vocab, (t,), generator=gen)).to(torch.int32)
    ids[cu[:-1].long()] = 0
    ids[(cu[1:] - 1).long()] = 2
    return (x.to(device, dtype), weight.to(device, dtype), bias.to(device), ids.to(device), cu.to(device),
            torch.tensor(M3_SPECIALS, dtype=torch.int32, device=device))


def peak_bytes(fn: Callable[[], object], device: str) -> int | None:
    """What one call allocates at its peak beyond what was allocated before it (its output included), on a GPU;
    None elsewhere."""
    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    del out
    return torch.cuda.max_memory_allocated() - before


def attention_flops(cu_seqlens, hidden: int, window: int = 0, terms: int = 0) -> int:
    """q k^T and p v over the real tokens: 2 x 2 x (query, key) pairs x head_dim per head and sequence, the pairs
    length^2, or with a window the pairs at most that far apart; DeBERTa's position terms add 2 x pairs x head_dim
    each (a dot product of the pair's query or key with its table row)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    if window > 0:
        reach = torch.minimum(lengths - 1, torch.full_like(lengths, window))  # the farthest distance within each
        pairs = lengths + 2 * (reach * lengths - reach * (reach + 1) // 2)  # distance 0, then each 1..reach twice
    else:
        pairs = lengths * lengths
    return (4 + 2 * terms) * int(pairs.sum()) * hidden


def min_bytes(op: str, rows: int, cols: int, dtype: torch.dtype) -> int:
    """Bytes a row-wise op must move at least: each input matrix read once, the output written once."""
    size = torch.finfo(dtype).bits // 8
    matrices = {"layer_norm": 2, "layer_norm_gelu": 2, "bias_gelu": 2, "bias_residual_gelu": 3,
                "add_layer_norm": 3, "embedding_layer_norm": 2}[op]
    ids = 3 * 8 * rows if op == "embedding_layer_norm" else 0
    return matrices * rows * cols * size + ids


def gemm_flops(m: int, k: int, n: int) -> int:
    return 2 * m * k * n


def cell_us(fn: Callable[[], object], device: str) -> float:
    """A cell's time of one call in microseconds: device time on a GPU, host time on the CPU (the module's
    docstring)."""
    if device.startswith("cuda"):
        return timing.device_us(fn, calls=1, rounds=DEVICE_ROUNDS, flush_l2=True)
    return timing.eager_us(fn, torch.device(device), calls=1, rounds=3, warmup=1)


def time_us(fn: Callable[[], object], device: str) -> tuple[float, float]:
    """(time, launch time) of one call in microseconds (see the module's docstring)."""
    if device.startswith("cuda"):
        return cell_us(fn, device), timing.eager_us(fn, torch.device(device), calls=10, rounds=5)
    host = cell_us(fn, device)
    return host, host


def copy_gbps(device: str) -> dict[str, float]:
    """The ceiling: a device-to-device copy's bytes read + written per second (1 GiB on a GPU), timed both ways a
    cell is (in a CUDA graph, where a copy can become a copy-engine node, and launched from Python, where it runs
    as a kernel), the faster taken as "copy_gbps"."""
    n = (1 << 30) if device.startswith("cuda") else (1 << 22)
    src = torch.randn(n // 4, device=device)
    dst = torch.empty_like(src)
    graph_us, launched_us = time_us(lambda: dst.copy_(src), device)
    rates = {"graph": 2 * n / graph_us / 1e3, "launched": 2 * n / launched_us / 1e3}
    return {"copy_gbps": max(rates.values()), "copy_gbps_by_timing": rates}


try:
    import triton
    import triton.language as tl
except ImportError:  # the suite runs without Triton too: its Triton provider reports itself unavailable
    triton = None
else:
    @triton.jit
    def _copy_kernel(X, Y, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        keep = offsets < n
        tl.store(Y + offsets, tl.load(X + offsets, mask=keep), mask=keep)


_COPY_KERNEL_CONFIGS = ((4096, 4), (8192, 8), (16384, 16))  # (elements per program, warps)


def same_bytes_copy_us(nbytes: int, device: str) -> float:
    """A cell's own ceiling: the time of a copy that moves the cell's bytes (reads half, writes half), timed as the
    cells are. At tens of MB a kernel's ramp-up and drain are a visible share of its time, so a copy of the same
    bytes reaches less than copy_gbps, the 1 GiB copy's rate. On a GPU the fastest of torch's copy_ and a Triton
    copy kernel in three tile sizes."""
    src = torch.randn(max(nbytes // 8, 1), device=device)  # float32: nbytes / 2 bytes read, as many written
    dst = torch.empty_like(src)
    times = [cell_us(lambda: dst.copy_(src), device)]
    if device.startswith("cuda") and triton is not None:
        for block, warps in _COPY_KERNEL_CONFIGS:
            grid = (triton.cdiv(src.numel(), block),)
            times.append(cell_us(lambda: _copy_kernel[grid](src, dst, src.numel(), BLOCK=block, num_warps=warps),
                                 device))
    return min(times)


def providers(names: list[str]) -> tuple[dict[str, Callable[[str], Callable]], dict[str, str]]:
    """({provider: op -> callable}, {provider: why it is unavailable})."""
    available: dict[str, Callable[[str], Callable]] = {}
    missing: dict[str, str] = {}
    if "eager" in names:
        available["eager"] = UNFUSED.__getitem__
    if "compile" in names:
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = 1024  # one compile per op x dtype x shape, never a fallback
        compiled: dict[str, Callable] = {}

        def get_compiled(op: str) -> Callable:
            if op not in compiled:
                compiled[op] = torch.compile(UNFUSED[op], dynamic=False)
            return compiled[op]

        available["compile"] = get_compiled
    if "triton" in names:
        try:
            from fusedserve.kernels.triton import LAUNCHERS as TRITON
        except ImportError as exc:
            missing["triton"] = f"{type(exc).__name__}: {exc}"
        else:
            available["triton"] = TRITON.__getitem__
    if "cuda" in names:
        from fusedserve.kernels import cuda

        try:
            available["cuda"] = cuda.load().__getitem__
        except (cuda.BuildUnavailable, OSError, RuntimeError) as exc:
            missing["cuda"] = f"{type(exc).__name__}: {exc}"
    for name, why in missing.items():
        print(f"provider {name}: unavailable ({why})", file=sys.stderr)
    return available, missing


def _measure(fn: Callable, inputs: tuple, ref, dtype: torch.dtype, device: str) -> dict:
    out = fn(*inputs)  # warm-up: compilation, autotuning and launch-configuration sweeps happen here
    out = out[0] if isinstance(out, tuple) else out
    err = compare(out, ref, dtype) if ref is not None else None
    us, launch_us = time_us(lambda: fn(*inputs), device)
    return {"us": us, "launch_us": launch_us, "rel_l2": err.rel_l2 if err else None,
            "max_abs": err.max_abs if err else None, "accurate": err.ok if err else None}


def fused_ops(args: argparse.Namespace, save: Callable[[list[dict], dict, bool], None]) -> None:
    device = args.device
    ops = args.ops or list(ROWWISE_OPS)
    shapes = args.shapes or list(SHAPES)
    dtypes = args.dtypes or list(DTYPES)
    measured = copy_gbps(device)
    ceiling = measured["copy_gbps"]
    print(f"copy ceiling: {ceiling:.0f} GB/s ({measured['copy_gbps_by_timing']})", file=sys.stderr, flush=True)
    provs, missing = providers(args.providers)
    summary = {**measured, "unavailable": missing, "same_bytes_copy_us": {}}
    copies = summary["same_bytes_copy_us"]
    rows: list[dict] = []
    cells = [(op, d, s) for op in ops for d in dtypes for s in shapes]
    for i, (op, dtype_name, shape) in enumerate(cells, 1):
        dtype = DTYPES[dtype_name]
        n_rows, cols = map(int, shape.split("x"))
        inputs = rowwise_inputs(op, n_rows, cols, dtype, device, seed=i)
        ref = float64_reference(op, inputs, {}) if args.check else None
        nbytes = min_bytes(op, n_rows, cols, dtype)
        if str(nbytes) not in copies:
            copies[str(nbytes)] = same_bytes_copy_us(nbytes, device)
        copy_us = copies[str(nbytes)]
        line = [f"same-bytes copy {copy_us:7.1f} us"]
        for name, get in provs.items():
            try:
                cell = _measure(get(op), inputs, ref, dtype, device)
            except Exception as exc:  # one provider failing a cell is reported in the row, the run goes on
                rows.append({"op": op, "dtype": dtype_name, "shape": shape, "provider": name,
                             "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                line.append(f"{name} FAILED")
                continue
            gbps = nbytes / cell["us"] / 1e3
            rows.append({"op": op, "dtype": dtype_name, "shape": shape, "provider": name, **cell, "bytes": nbytes,
                         "gbps": gbps, "pct_copy": 100 * gbps / ceiling, "copy_us": copy_us,
                         "pct_same_bytes_copy": 100 * copy_us / cell["us"]})
            line.append(f"{name} {cell['us']:7.1f} us {gbps:5.0f} GB/s")
        print(f"[{i}/{len(cells)}] {op} {dtype_name} {shape}: " + " | ".join(line), file=sys.stderr, flush=True)
        save(rows, summary, False)
    if device.startswith("cuda") and {"triton", "cuda"} <= set(provs):
        summary["auto_choices"] = auto_choices(device, torch.float16, AUTO_WIDTHS)
    save(rows, summary, True)


def auto_choices(device: str, dtype: torch.dtype, widths: tuple[int, ...]) -> dict:
    """What the registry's auto mode picks for each row-wise op (its start-up race, device-timed as under CUDA
    graphs) at the serving dtype and each model width."""
    from fusedserve import kernels

    out = {}
    for cols in widths:
        selection = kernels.select(device, (dtype,), hidden_sizes=(cols,), race_timing="device", ops=ROWWISE_OPS)
        key = f"{str(dtype).removeprefix('torch.')} {cols}"
        out[key] = {op: {"backend": selection.backend_of(op),
                         "timings_us": dict(selection.choices[op].timings_us) or None} for op in ROWWISE_OPS}
        print(f"auto mode {key}: " + ", ".join(f"{op}={c['backend']}" for op, c in out[key].items()),
              file=sys.stderr, flush=True)
    return out


def gemm_epilogues(args: argparse.Namespace, save: Callable[[list[dict], dict, bool], None]) -> None:
    device = args.device
    names = args.gemm_shapes or list(DEFAULT_GEMM_SHAPES)
    dtypes = args.dtypes or (["float16"] if device.startswith("cuda") else ["float32"])
    provs, missing = providers(args.providers)
    rows: list[dict] = []
    summary = {"unavailable": missing}
    for i, (name, dtype_name) in enumerate([(n, d) for n in names for d in dtypes], 1):
        op, m, k, n = GEMM_SHAPES[name]
        dtype = DTYPES[dtype_name]
        inputs = gemm_inputs(op, m, k, n, dtype, device, seed=i)
        ref = float64_reference(op, inputs, {}) if args.check else None
        line = []
        for provider, get in provs.items():
            try:
                cell = _measure(get(op), inputs, ref, dtype, device)
            except Exception as exc:
                rows.append({"op": op, "case": name, "dtype": dtype_name, "shape": f"{m}x{k}x{n}",
                             "provider": provider, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                line.append(f"{provider} FAILED")
                continue
            tflops = gemm_flops(m, k, 2 * n if op == "linear_glu" else n) / cell["us"] / 1e6
            rows.append({"op": op, "case": name, "dtype": dtype_name, "shape": f"{m}x{k}x{n}", "provider": provider,
                         **cell, "tflops": tflops})
            line.append(f"{provider} {cell['us']:7.1f} us {tflops:6.1f} TFLOP/s")
        print(f"{name} {dtype_name}: " + " | ".join(line), file=sys.stderr, flush=True)
        save(rows, summary, False)
    save(rows, summary, True)


# gemm-fp8: name -> (hidden, FFN width, tokens); the layer's GEMMs as (in features K, out features N)
FP8_CASES = {
    "minilm 16 tokens": (384, 1536, 16),
    "minilm 4096 tokens": (384, 1536, 4096),
    "bert-base 4096 tokens": (768, 3072, 4096),
    "bert-base 8990 tokens": (768, 3072, 8990),  # the b128 varlen row's real tokens
    "tiny 8 tokens": (16, 64, 8),  # the CPU test's: not in the default set
}
DEFAULT_FP8_CASES = tuple(name for name in FP8_CASES if not name.startswith("tiny"))
FP8_PROVIDERS = ("fp16", "fp8", "fp8 + quantize")
# E4M3 keeps 3 mantissa bits: a value's rounding error is up to 2^-4 of it. With a scale per token and per output
# channel a GEMM's relative error norm stays near that (3-4% on random data), well above fp16's table entry: an FP8
# cell is accurate within this bound, as a measurement; the serving path's own bound is its embeddings' cosine.
FP8_REL_L2 = 0.06


def layer_gemms(hidden: int, inner: int) -> dict[str, tuple[int, int]]:
    return {"qkv": (hidden, 3 * hidden), "attn_out": (hidden, hidden), "ffn_in": (hidden, inner),
            "ffn_out": (inner, hidden)}



# (ROWS, num_warps) of the FP8 quantizing kernels' launch sweep; ROWS x the row's power-of-two block stays within
# 16,384 elements a program (the registers of 8 warps)
FP8_LAUNCHES = ((1, 1), (1, 2), (1, 4), (1, 8), (2, 1), (2, 2), (2, 4), (4, 2), (4, 4), (4, 8), (8, 4), (8, 8),
                (16, 4), (16, 8))


def quantize_launches(hidden: int, inner: int, m: int, device: str, rows: list[dict], case: str, seed: int) -> dict:
    """The FP8 quantizing kernels (kernels/triton/fp8.py) at one case's widths, timed at each (ROWS, num_warps) of
    FP8_LAUNCHES and at launch_config's default; a row per launch, and per kernel the default's and the best one's
    time (what launch_config's choices are taken from)."""
    from fusedserve.kernels.triton import fp8 as triton_fp8

    gen = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(m, hidden, generator=gen).to(device, torch.float16)
    h = torch.randn(m, inner, generator=gen).to(device, torch.float16)
    r = torch.randn(m, hidden, generator=gen).to(device, torch.float16)
    bh, bi = (torch.randn(n, generator=gen).to(device, torch.float16) * 0.1 for n in (hidden, inner))
    w = (1 + torch.randn(hidden, generator=gen) * 0.1).to(device, torch.float16)
    kernels = {"quantize_rows": (hidden, lambda c: triton_fp8.quantize_rows(x, c)),
               "bias_gelu_quantize": (inner, lambda c: triton_fp8.bias_gelu_quantize(h, bi, c)),
               "add_layer_norm_quantize": (hidden, lambda c: triton_fp8.add_layer_norm_quantize(
                   x, r, bh, w, bh, 1e-12, c))}
    best: dict = {}
    for kernel, (cols, call) in kernels.items():
        block = triton_fp8.launch_config(cols)[0]
        default = triton_fp8.launch_config(cols)
        times = {}
        for n_rows, warps in FP8_LAUNCHES:
            if n_rows * block > 16384:
                continue
            config = (block, n_rows, warps)
            us = cell_us(lambda: call(config), device)
            times[config] = us
            rows.append({"op": f"{kernel} launch", "case": case, "dtype": "float16", "shape": f"{m}x{cols}",
                         "provider": f"rows {n_rows}, {warps} warps", "us": us,
                         "default": config == default})
        fastest = min(times, key=times.get)
        best[kernel] = {"cols": cols, "default": list(default), "default_us": times.get(default),
                        "best": list(fastest), "best_us": times[fastest]}
        print(f"{case} {kernel} ({m}x{cols}): default rows {default[1]}, {default[2]} warps "
              f"{times.get(default, math.nan):.1f} us; best rows {fastest[1]}, {fastest[2]} warps "
              f"{times[fastest]:.1f} us", file=sys.stderr, flush=True)
    return best


def gemm_fp8(args: argparse.Namespace, save: Callable[[list[dict], dict, bool], None]) -> None:
    device = args.device
    names = args.fp8_shapes or list(DEFAULT_FP8_CASES)
    rows: list[dict] = []
    summary: dict = {"layers": {}}
    seed = 0
    for name in names:
        hidden, inner, m = FP8_CASES[name]
        sums = dict.fromkeys(FP8_PROVIDERS, 0.0)
        for gemm, (k, n) in layer_gemms(hidden, inner).items():
            seed += 1
            gen = torch.Generator().manual_seed(seed)
            x = torch.randn(m, k, generator=gen).to(device, torch.float16)  # an activation after LayerNorm
            # outputs of unit scale, so the error is relative to the output (compare floors its norm at an RMS of 1)
            w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(device, torch.float16)
            b = (torch.randn(n, generator=gen) * 0.1).to(device, torch.float16)
            ref = x.double() @ w.double().t() + b.double()
            # the serving path's quantization (kernels/fp8.py); "fp8 + quantize" quantizes x with PyTorch ops
            weight = fp8.quantize_weight(w)
            xq, x_scale = fp8.quantize_rows_reference(x)
            calls = {"fp16": lambda: F.linear(x, w, b),
                     "fp8": lambda: fp8.linear(xq, x_scale, weight, b, b.dtype),
                     "fp8 + quantize": lambda: fp8.linear(*fp8.quantize_rows_reference(x), weight, b, b.dtype)}
            line = []
            for provider, fn in calls.items():
                try:
                    out = fn()
                    us = cell_us(fn, device)
                except Exception as exc:  # a torch without row-wise FP8 GEMMs on this device
                    rows.append({"op": gemm, "case": name, "dtype": "float16", "shape": f"{m}x{k}x{n}",
                                 "provider": provider, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                    sums[provider] = math.nan
                    line.append(f"{provider} FAILED")
                    continue
                err = compare(out, ref, torch.float16)
                accurate = err.ok if provider == "fp16" else math.isfinite(err.rel_l2) and err.rel_l2 <= FP8_REL_L2
                # dtype: the activations' and the output's (the fp8 providers' GEMM inputs are E4M3)
                rows.append({"op": gemm, "case": name, "dtype": "float16", "shape": f"{m}x{k}x{n}",
                             "provider": provider, "us": us,
                             "tflops": gemm_flops(m, k, n) / us / 1e6, "rel_l2": err.rel_l2, "max_abs": err.max_abs,
                             "accurate": accurate})
                sums[provider] += us
                line.append(f"{provider} {us:7.1f} us")
            print(f"{name} {gemm}: " + " | ".join(line), file=sys.stderr, flush=True)
        summary["layers"][name] = {"us": sums, "fp8_speedup": sums["fp16"] / sums["fp8"],
                                   "fp8_quantize_speedup": sums["fp16"] / sums["fp8 + quantize"]}
        print(f"{name}: one layer's GEMMs fp16 {sums['fp16']:.1f} us, fp8 {sums['fp8']:.1f} us, with the "
              f"activations' quantization {sums['fp8 + quantize']:.1f} us", file=sys.stderr, flush=True)
        if device.startswith("cuda") and m > 16:
            summary.setdefault("launch", {})[name] = quantize_launches(hidden, inner, m, device, rows, name, seed)
        save(rows, summary, False)
    save(rows, summary, True)


def attention(args: argparse.Namespace, save: Callable[[list[dict], dict, bool], None]) -> None:
    device = args.device
    names = args.attention_shapes or list(DEFAULT_ATTENTION_SHAPES)
    dtypes = args.dtypes or (["float16", "bfloat16"] if device.startswith("cuda") else ["float32"])
    ops = {ATTENTION_SHAPES[name][0] for name in names}
    # a fused backend without the cases' ops (the CUDA backend has no attention) is left out, neither loaded nor
    # failing; one that has some of them runs those
    fused = ("triton", "cuda")
    provs, missing = providers([p for p in args.providers
                                if p not in fused or any(p in OP_SPECS[op].fused_in for op in ops)])
    rows: list[dict] = []
    summary = {"unavailable": missing}
    for i, (name, dtype_name) in enumerate([(n, d) for n in names for d in dtypes], 1):
        dtype = DTYPES[dtype_name]
        op = ATTENTION_SHAPES[name][0]
        inputs = attention_inputs(name, dtype, device, seed=i)
        qkv, cu = inputs[0], inputs[1]
        # the float64 reference on the device: on a CPU its [batch, heads, seq, seq] bias and scores (GBs at b128
        # s512) take minutes
        ref = (OP_SPECS[op].reference(*(a.double() if torch.is_tensor(a) and a.is_floating_point() else a
                                        for a in inputs)) if args.check else None)
        flops = attention_flops(cu, qkv.shape[1] // 3, inputs[5] if op == "rotary_attention" else 0,
                                sum(t is not None for t in inputs[4:6]) if op == "disentangled_attention" else 0)
        shape = f"{qkv.shape[0]}x{qkv.shape[1]}"
        line = []
        for provider, get in provs.items():
            if provider in fused and provider not in OP_SPECS[op].fused_in:
                continue
            try:
                cell = _measure(get(op), inputs, ref, dtype, device)
            except Exception as exc:
                rows.append({"op": op, "case": name, "dtype": dtype_name, "shape": shape, "provider": provider,
                             "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                line.append(f"{provider} FAILED")
                continue
            tflops = flops / cell["us"] / 1e6
            rows.append({"op": op, "case": name, "dtype": dtype_name, "shape": shape, "provider": provider, **cell,
                         "flops": flops, "tflops": tflops})
            line.append(f"{provider} {cell['us']:8.1f} us {tflops:6.1f} TFLOP/s")
        del ref
        print(f"{name} {dtype_name}: " + " | ".join(line), file=sys.stderr, flush=True)
        save(rows, summary, False)
    save(rows, summary, True)


def decoder_ops(args: argparse.Namespace, save: Callable[[list[dict], dict, bool], None]) -> None:
    device = args.device
    cuda = device.startswith("cuda")
    shapes = args.decoder_shapes or list(DEFAULT_DECODER_SHAPES)
    dtypes = args.dtypes or (["float16", "bfloat16"] if cuda else ["float32"])
    ops = args.decoder_ops or list(DECODER_OPS)
    names = [p for p in DECODER_PROVIDERS if p in args.decoder_providers]
    provs: dict[str, Callable[[str], Callable]] = {}
    missing: dict[str, str] = {}
    if "ours" in names:
        provs["ours"] = _ours
    if "eager" in names:
        provs["eager"] = DECODER_UNFUSED.__getitem__
    if "compile" in names:
        from torch import _dynamo as dynamo

        dynamo.config.cache_size_limit = 1024
        compiled = {op: torch.compile(fn, dynamic=False) for op, fn in DECODER_UNFUSED.items()}
        provs["compile"] = compiled.__getitem__
    if "liger" in names:
        try:
            provs["liger"] = _liger_ops().__getitem__
        except ImportError as exc:  # an optional bench dependency: its rows are skipped, and the summary says why
            missing["liger"] = f"{type(exc).__name__}: {exc}"
            print(f"provider liger: unavailable ({missing['liger']})", file=sys.stderr)
    measured = copy_gbps(device)
    summary: dict = {**measured, "unavailable": missing}
    rows: list[dict] = []
    cells = [(op, d, s) for op in ops for d in dtypes for s in shapes]
    for i, (op, dtype_name, shape) in enumerate(cells, 1):
        dtype = DTYPES[dtype_name]
        inputs = decoder_inputs(op, shape, dtype, device, seed=i)
        nbytes, flops = decoder_cost(op, shape, dtype)
        ref = None
        if args.check:  # transformers' formulas on the float64 copies of the same (rounded) inputs, on the device
            ref = _as_rows(op, DECODER_UNFUSED[op](*(x.double() if torch.is_tensor(x) and x.is_floating_point() else x
                                                      for x in inputs)), None)
        line = []
        for name, get in provs.items():
            try:
                fn = get(op)
                out = fn(*inputs)  # warm-up: compilation, autotuning
                err = compare(_as_rows(op, out, inputs[0].shape), ref, dtype) if ref is not None else None
                us, launch_us = time_us(lambda: fn(*inputs), device)
            except Exception as exc:  # one provider failing a cell is reported in the row, the run goes on
                rows.append({"op": op, "dtype": dtype_name, "shape": shape, "provider": name,
                             "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                line.append(f"{name} FAILED")
                continue
            rows.append({"op": op, "dtype": dtype_name, "shape": shape, "provider": name, "us": us,
                         "launch_us": launch_us, "bytes": nbytes, "gbps": nbytes / us / 1e3,
                         "pct_copy": 100 * nbytes / us / 1e3 / measured["copy_gbps"],
                         "tflops": flops / us / 1e6 if flops else None,
                         "rel_l2": err.rel_l2 if err else None, "max_abs": err.max_abs if err else None,
                         "accurate": err.ok if err else None})
            line.append(f"{name} {us:8.1f} us")
        print(f"[{i}/{len(cells)}] {op} {dtype_name} {shape} ({nbytes / 1e6:.0f} MB): " + " | ".join(line),
              file=sys.stderr, flush=True)
        summary.update(decoder_summary(rows))
        save(rows, summary, False)
    save(rows, summary, True)


def decoder_summary(rows: list[dict], min_mb: float = 25.0) -> dict:
    """Ours against the best of torch.compile and Liger per cell ("vs_best_peer": their time over ours), and the
    geometric mean over the cells of at least min_mb megabytes."""
    cells: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if "us" in r:
            cells.setdefault((r["op"], r["dtype"], r["shape"]), {})[r["provider"]] = r
    ratios = {}
    for (op, dtype, shape), by in cells.items():
        peers = [by[p]["us"] for p in ("compile", "liger") if p in by]
        if "ours" in by and peers:
            ratios[f"{op}|{dtype}|{shape}"] = {"vs_best_peer": min(peers) / by["ours"]["us"],
                                               "mb": by["ours"]["bytes"] / 1e6}
    large = [v["vs_best_peer"] for v in ratios.values() if v["mb"] >= min_mb]
    geomean = math.exp(sum(map(math.log, large)) / len(large)) if large else None
    return {"vs_best_peer": ratios, "geomean_vs_best_peer": geomean, "min_mb": min_mb,
            "worst_vs_best_peer": min(large) if large else None}


def splade(args: argparse.Namespace, save: Callable[[list[dict], dict, bool], None]) -> None:
    device = args.device
    names = args.splade_shapes or list(DEFAULT_SPLADE_SHAPES)
    dtypes = args.dtypes or (["float16", "bfloat16"] if device.startswith("cuda") else ["float32"])
    fused = ("triton", "cuda")  # the CUDA backend has no splade_pool: left out, neither loaded nor failing
    provs, missing = providers([p for p in args.providers
                                if p not in fused or p in OP_SPECS["splade_pool"].fused_in])
    rows: list[dict] = []
    summary = {"unavailable": missing}
    for i, (name, dtype_name) in enumerate([(n, d) for n in names for d in dtypes], 1):
        dtype = DTYPES[dtype_name]
        inputs = splade_inputs(name, dtype, device, seed=i)
        x, weight = inputs[0], inputs[1]
        # the float64 reference on the device (on a CPU the [T, V] float64 logits of a large case take minutes)
        ref = (OP_SPECS["splade_pool"].reference(*(a.double() if a.is_floating_point() else a for a in inputs))
               if args.check else None)
        flops = gemm_flops(x.shape[0], x.shape[1], weight.shape[0])
        shape = f"{x.shape[0]}x{x.shape[1]}x{weight.shape[0]}"
        line = []
        for provider, get in provs.items():
            try:
                fn = get("splade_pool")
                cell = _measure(fn, inputs, ref, dtype, device)
                peak = peak_bytes(lambda: fn(*inputs), device)
            except Exception as exc:
                rows.append({"op": "splade_pool", "case": name, "dtype": dtype_name, "shape": shape,
                             "provider": provider, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                line.append(f"{provider} FAILED")
                continue
            tflops = flops / cell["us"] / 1e6
            rows.append({"op": "splade_pool", "case": name, "dtype": dtype_name, "shape": shape, "provider": provider,
                         **cell, "flops": flops, "tflops": tflops, "peak_bytes": peak})
            line.append(f"{provider} {cell['us']:8.1f} us {tflops:6.1f} TFLOP/s"
                        + (f" peak {peak / 2**20:7.1f} MiB" if peak is not None else ""))
        del ref
        print(f"{name} {dtype_name}: " + " | ".join(line), file=sys.stderr, flush=True)
        save(rows, summary, False)
    save(rows, summary, True)


def m3_sparse(args: argparse.Namespace, save: Callable[[list[dict], dict, bool], None]) -> None:
    device = args.device
    names = args.m3_sparse_shapes or list(DEFAULT_M3_SPARSE_SHAPES)
    dtypes = args.dtypes or (["float16", "bfloat16"] if device.startswith("cuda") else ["float32"])
    names_wanted = [p for p in args.providers if p in ("triton", "eager", "compile")]  # no CUDA m3_sparse
    provs, missing = providers([p for p in names_wanted if p == "triton"])
    if "compile" in names_wanted:
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = 1024  # one compile per dtype x shape, never a fallback
        compiled = torch.compile(dense_m3_sparse, dynamic=False)
    rows: list[dict] = []
    summary = {"unavailable": missing}
    for i, (name, dtype_name) in enumerate([(n, d) for n in names for d in dtypes], 1):
        dtype = DTYPES[dtype_name]
        vocab = M3_SPARSE_SHAPES[name][4]
        inputs = m3_sparse_inputs(name, dtype, device, seed=i)
        x, ids, cu = inputs[0], inputs[3], inputs[4]
        # the float64 reference on the device, compared in the dense form: two tokens within rounding of each other
        # may be ranked either way by a provider, the per-(sequence, id) maxima may not
        ref = (per_token_dense(OP_SPECS["m3_sparse"].reference(
            *(a.double() if a.is_floating_point() else a for a in inputs)), ids, cu, vocab) if args.check else None)
        calls = {p: get("m3_sparse") for p, get in provs.items()}
        if "eager" in names_wanted:
            calls["eager"] = lambda *a, vocab=vocab: dense_m3_sparse(*a, vocab=vocab)
        if "compile" in names_wanted:
            calls["compile"] = lambda *a, vocab=vocab: compiled(*a, vocab=vocab)
        shape = f"{x.shape[0]}x{x.shape[1]}x{vocab}"
        nbytes = x.numel() * x.element_size()
        line = []
        for provider in names_wanted:
            if provider not in calls:
                continue
            fn = calls[provider]
            try:
                out = fn(*inputs)  # warm-up: compilation happens here
                err = None
                if ref is not None:
                    dense = out if out.dim() == 2 else per_token_dense(out, ids, cu, vocab)
                    err = compare(dense, ref, dtype)
                del out
                us, launch_us = time_us(lambda: fn(*inputs), device)
                peak = peak_bytes(lambda: fn(*inputs), device)
            except Exception as exc:
                rows.append({"op": "m3_sparse", "case": name, "dtype": dtype_name, "shape": shape,
                             "provider": provider, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                line.append(f"{provider} FAILED")
                continue
            rows.append({"op": "m3_sparse", "case": name, "dtype": dtype_name, "shape": shape, "provider": provider,
                         "us": us, "launch_us": launch_us, "rel_l2": err.rel_l2 if err else None,
                         "max_abs": err.max_abs if err else None, "accurate": err.ok if err else None,
                         "bytes": nbytes, "gbps": nbytes / us / 1e3, "peak_bytes": peak})
            line.append(f"{provider} {us:8.1f} us" + (f" peak {peak / 2**20:7.1f} MiB" if peak is not None else ""))
        del ref
        print(f"{name} {dtype_name}: " + " | ".join(line), file=sys.stderr, flush=True)
        save(rows, summary, False)
    save(rows, summary, True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenarios", nargs="*", metavar="SCENARIO", help=f"any of {', '.join(SCENARIOS)} (default: all)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    parser.add_argument("--ops", nargs="+", choices=list(ROWWISE_OPS), help="fused-ops: the ops (default: all)")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES),
                        help="default: all three for fused-ops; float16 (cpu: float32) for gemm-epilogues; float16 "
                             "and bfloat16 (cpu: float32) for attention, splade and m3-sparse")
    parser.add_argument("--shapes", nargs="+", help=f"fused-ops: ROWSxCOLS (default: {' '.join(SHAPES)})")
    parser.add_argument("--gemm-shapes", nargs="+", choices=list(GEMM_SHAPES),
                        help=f"gemm-epilogues: the cases (default: {', '.join(DEFAULT_GEMM_SHAPES)})")
    parser.add_argument("--fp8-shapes", nargs="+", choices=list(FP8_CASES),
                        help=f"gemm-fp8: the cases (default: {', '.join(DEFAULT_FP8_CASES)})")
    parser.add_argument("--attention-shapes", nargs="+", choices=list(ATTENTION_SHAPES),
                        help=f"attention: the cases (default: {', '.join(DEFAULT_ATTENTION_SHAPES)})")
    parser.add_argument("--splade-shapes", nargs="+", choices=list(SPLADE_SHAPES),
                        help=f"splade: the cases (default: {', '.join(DEFAULT_SPLADE_SHAPES)})")
    parser.add_argument("--m3-sparse-shapes", nargs="+", choices=list(M3_SPARSE_SHAPES),
                        help=f"m3-sparse: the cases (default: {', '.join(DEFAULT_M3_SPARSE_SHAPES)})")
    parser.add_argument("--decoder-shapes", nargs="+", choices=list(DECODER_SHAPES),
                        help=f"decoder-ops: the cases (default: {', '.join(DEFAULT_DECODER_SHAPES)})")
    parser.add_argument("--decoder-ops", nargs="+", choices=DECODER_OPS, help="decoder-ops: the ops (default: all)")
    parser.add_argument("--decoder-providers", nargs="+", choices=DECODER_PROVIDERS, default=list(DECODER_PROVIDERS),
                        help="decoder-ops: the providers (liger: where Liger-Kernel is installed)")
    parser.add_argument("--no-check", dest="check", action="store_false", help="skip the float64 accuracy check")
    parser.add_argument("--out", help="the results file (default: bench/results/<gpu>/kernels.json)")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    out = args.out or store.default_path("kernels", args.device)
    gpu = store.gpu_slug(torch.cuda.get_device_name(torch.device(args.device))
                         if args.device.startswith("cuda") else None)
    started = time.monotonic()
    for scenario in args.scenarios or SCENARIOS:
        head = store.header(args.device, argv)
        settings = {"device": args.device, "providers": args.providers, "ops": args.ops, "dtypes": args.dtypes,
                    "shapes": {"fused-ops": args.shapes, "gemm-epilogues": args.gemm_shapes, "gemm-fp8": args.fp8_shapes,
                               "attention": args.attention_shapes, "decoder-ops": args.decoder_shapes,
                               "splade": args.splade_shapes, "m3-sparse": args.m3_sparse_shapes}[scenario],
                    "device_rounds": DEVICE_ROUNDS, "check": args.check}

        def save(rows: list[dict], summary: dict, complete: bool, scenario: str = scenario, head: dict = head,
                 settings: dict = settings) -> None:
            store.write(out, "kernels", gpu, scenario, store.block(head, settings, rows, summary, complete=complete))

        {"fused-ops": fused_ops, "gemm-epilogues": gemm_epilogues, "gemm-fp8": gemm_fp8, "attention": attention,
         "decoder-ops": decoder_ops, "splade": splade, "m3-sparse": m3_sparse}[scenario](args, save)
        print(f"{scenario}: {out} ({time.monotonic() - started:.0f} s into the run)", file=sys.stderr, flush=True)
    return 0
