"""Triton embedding + LayerNorm: gather word, position and token-type rows, sum, normalize; one kernel
for the encoder's first step. Ids must be in range (the tokenizer and the server's validation ensure it)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels._layout import embedding_inputs
from kernels.triton._common import (as_vector, autotune, block_cols, check_device, needs_wide, pdl_args, pdl_sync,
                                    row_bucket)
from kernels.triton._norm import _CONFIGS, _prune, layer_norm_stats


@autotune(_CONFIGS, key=["N", "M_BUCKET"], prune=_prune)
@triton.jit(do_not_specialize=["M", "M_BUCKET"])  # counts: see _common.autotune
def _embedding_layer_norm_kernel(
    IDS,  # [M] token ids
    POS,  # [M] position ids
    TYPES,  # [M] token-type ids
    WORD,  # [vocab, N] word embeddings
    POSITION,  # [positions, N] position embeddings
    TOKEN_TYPE,  # [types, N] token-type embeddings
    W,  # [N] LayerNorm weight
    B,  # [N] LayerNorm bias
    Y,  # [M, N] output
    stride_word, stride_pos, stride_type, stride_y,
    M, N, eps,
    M_BUCKET,  # autotune key only
    F64: tl.constexpr,
    WIDE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # launched with programmatic dependent launch (_common.pdl_args)
):
    pid = tl.program_id(0)
    if WIDE:  # offsets past 2^31 elements need 64-bit arithmetic; otherwise 32-bit is cheaper per element
        pid = pid.to(tl.int64)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    pdl_sync(USE_PDL)

    word = tl.load(IDS + rows, mask=row_ok, other=0).to(tl.int64)
    pos = tl.load(POS + rows, mask=row_ok, other=0).to(tl.int64)
    ttype = tl.load(TYPES + rows, mask=row_ok, other=0).to(tl.int64)
    # h = word[id] + position[pos] + token_type[type]
    h = tl.load(WORD + word[:, None] * stride_word + cols[None, :], mask=mask, other=0.0)
    h = h.to(tl.float64) if F64 else h.to(tl.float32)
    h += tl.load(POSITION + pos[:, None] * stride_pos + cols[None, :], mask=mask, other=0.0).to(h.dtype)
    h += tl.load(TOKEN_TYPE + ttype[:, None] * stride_type + cols[None, :], mask=mask, other=0.0).to(h.dtype)

    mean, rstd = layer_norm_stats(h, mask, N, eps)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(h.dtype)
    b = tl.load(B + cols, mask=col_ok, other=0.0).to(h.dtype)
    # y = (h - mean) * rstd * w + b, from the same masked (h - mean) the variance was summed over: the compiler
    # computes it once, so this kernel compiles to the code it had with the statistics written inline
    y = tl.where(mask, h - mean[:, None], 0.0) * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def embedding_layer_norm(input_ids: Tensor, position_ids: Tensor, token_type_ids: Tensor, word_embeddings: Tensor,
                         position_embeddings: Tensor, token_type_embeddings: Tensor, weight: Tensor, bias: Tensor,
                         eps: float = 1e-12, *, out: Tensor | None = None) -> Tensor:
    check_device("embedding_layer_norm", word_embeddings, position_embeddings, token_type_embeddings, weight, bias)
    name = "embedding_layer_norm"
    ids, pos, types, word, position, token_type, y, shape = embedding_inputs(
        input_ids, position_ids, token_type_ids, word_embeddings, position_embeddings, token_type_embeddings, out)
    rows, cols = y.shape
    if rows:
        def grid(meta):
            return (triton.cdiv(rows, meta["BLOCK_M"]),)

        _embedding_layer_norm_kernel[grid](
            ids, pos, types, word, position, token_type, as_vector(weight, cols, f"{name} weight"),
            as_vector(bias, cols, f"{name} bias"), y,
            word.stride(0), position.stride(0), token_type.stride(0), y.stride(0),
            rows, cols, eps, row_bucket(rows),
            F64=word.dtype == torch.float64, WIDE=needs_wide(y), BLOCK_N=block_cols(cols), **pdl_args(y),
        )
    return out if out is not None else y.view(shape)
