"""The one LayerNorm-family kernel behind layer_norm, layer_norm_gelu and add_layer_norm, and the row statistics
(`layer_norm_stats`) every Triton LayerNorm computes with, embedding + LayerNorm's included.

Each program normalizes BLOCK_M whole rows held in registers (one read of every input, one write of
every output); constexpr flags switch the residual/bias add, the pre-norm-sum store and the GELU, so each
op compiles to exactly the code it needs. One kernel body instead of three near-copies of the same
reduction: the per-op files hold only launchers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.triton._common import autotune, block_cols, needs_wide, pdl_args, pdl_sync, row_bucket, tile_configs
from kernels.triton._gelu import gelu


# Below this many rows the candidates also hold 512-2048 elements (1-4 rows of a 384-768-wide model): a 4096-element
# tile puts a b1 s16 batch's 16 rows of 384 into 2 programs, i.e. on 2 SMs, where 16 one-row programs spread it.
SMALL_ROWS = 256


def _prune(configs, named_args, **kwargs):
    # Tiles of 4096 / 8192 / 16384 elements (heuristic: 4096; a few rows also try 512 / 1024 / 2048), 8 or 16
    # elements per thread (16-byte vectors of half types, no spills); BLOCK_N is fixed by the row width.
    tiles = (4096, 8192, 16384) + ((512, 1024, 2048) if named_args["M"] <= SMALL_ROWS else ())
    wanted = tile_configs(kwargs["BLOCK_N"], tiles=tiles, per_thread=(16, 8))
    return [c for w in wanted for c in configs
            if c.kwargs["BLOCK_M"] == w.kwargs["BLOCK_M"] and c.num_warps == w.num_warps]


@triton.jit
def layer_norm_stats(h, mask, N, eps):
    """Mean and 1/std of each row of the [BLOCK_M, BLOCK_N] tile `h`, in h's dtype (fp32 statistics; fp64 for fp64
    inputs). `mask` marks the tile's real elements, and h must be 0 outside it (loads with other=0.0): the mean's sum
    then needs no mask, the variance's does. Two passes over registers, no re-read of the input: the centered pass
    is the exact one (no E[h^2] - mean^2 cancellation)."""
    # mean = sum(h) / N; var = sum((h - mean)^2) / N; rstd = 1 / sqrt(var + eps)
    mean = tl.sum(h, axis=1) / N
    centered = tl.where(mask, h - mean[:, None], 0.0)
    var = tl.sum(centered * centered, axis=1) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    return mean, rstd


_CONFIGS = [
    triton.Config({"BLOCK_M": 2**m}, num_warps=2**w)
    for m in range(13)  # BLOCK_M 1 .. 4096 (4096 rows only for single-column rows)
    for w in range(5)  # 1 .. 16 warps
]


@autotune(_CONFIGS, key=["N", "M_BUCKET", "HAS_RESIDUAL", "HAS_BIAS", "STORE_SUM", "GELU", "PARTS"], prune=_prune)
@triton.jit(do_not_specialize=["M", "M_BUCKET"])  # counts: see _common.autotune
def _norm_kernel(
    X,  # [M, N] input; with PARTS, [P, M, N] partial sums (summed in order, then as one input)
    R,  # [M, N] residual (unused unless HAS_RESIDUAL)
    BIAS,  # [N] bias added before the norm (unused unless HAS_BIAS)
    W,  # [N] LayerNorm weight
    B,  # [N] LayerNorm bias
    Y,  # [M, N] output
    S,  # [M, N] pre-norm sum output (unused unless STORE_SUM)
    stride_x, stride_r, stride_y, stride_s,  # row strides; columns are unit-stride
    stride_p,  # with PARTS: the stride between X's partial sums
    M, N, eps,
    M_BUCKET,  # autotune key only
    PARTS: tl.constexpr,  # how many partial sums X holds (1: a plain [M, N] input)
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STORE_SUM: tl.constexpr,
    GELU: tl.constexpr,
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
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    mask = (rows < M)[:, None] & col_ok[None, :]
    pdl_sync(USE_PDL)

    h = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    h = h.to(tl.float64) if F64 else h.to(tl.float32)
    # the other partial products of a split GEMM, in a fixed order (deterministic). Unrolled: the loads are
    # independent and in flight together (a runtime loop waits out one memory latency per part, which dominates a
    # few-token batch's LayerNorm)
    for part in tl.static_range(1, PARTS):
        h += tl.load(X + part * stride_p + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(h.dtype)
    if HAS_RESIDUAL:
        h += tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(h.dtype)
    if HAS_BIAS:
        h += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(h.dtype)[None, :]
    if STORE_SUM:
        tl.store(S + rows[:, None] * stride_s + cols[None, :], h.to(S.dtype.element_ty), mask=mask)

    mean, rstd = layer_norm_stats(h, mask, N, eps)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(h.dtype)
    b = tl.load(B + cols, mask=col_ok, other=0.0).to(h.dtype)
    # y = (h - mean) * rstd * w + b, from the same masked (h - mean) the variance was summed over: the compiler
    # computes it once, so this kernel compiles to the code it had with the statistics written inline
    y = tl.where(mask, h - mean[:, None], 0.0) * rstd[:, None] * w[None, :] + b[None, :]
    y = gelu(y, GELU)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def launch_norm(x: Tensor, residual: Tensor | None, bias: Tensor | None, weight: Tensor, ln_bias: Tensor,
                y: Tensor, pre_norm_sum: Tensor | None, eps: float, gelu_mode: int, parts: Tensor | None = None) -> None:
    """All tensors already validated: x, residual, y, pre_norm_sum are [M, N] with unit column stride. `parts`
    ([P, M, N], contiguous, x = parts[0]): the input is the sum of its P slices."""
    rows, cols = x.shape
    if rows == 0:
        return

    def grid(meta):
        return (triton.cdiv(rows, meta["BLOCK_M"]),)

    _norm_kernel[grid](
        x, residual if residual is not None else x, bias if bias is not None else weight, weight, ln_bias,
        y, pre_norm_sum if pre_norm_sum is not None else y,
        x.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0),
        pre_norm_sum.stride(0) if pre_norm_sum is not None else 0,
        parts.stride(0) if parts is not None else 0,
        rows, cols, eps, row_bucket(rows), PARTS=parts.shape[0] if parts is not None else 1,
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, STORE_SUM=pre_norm_sum is not None,
        GELU=gelu_mode, F64=x.dtype == torch.float64,
        WIDE=needs_wide(x, residual, y, pre_norm_sum) or (parts is not None and parts.numel() >= 2**31),
        BLOCK_N=block_cols(cols), **pdl_args(x),
    )

