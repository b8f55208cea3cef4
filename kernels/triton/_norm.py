"""The one LayerNorm-family kernel body behind layer_norm, layer_norm_gelu, add_layer_norm, partial_add_layer_norm,
embedding_layer_norm, rms_norm and add_rms_norm.

Each program normalizes BLOCK_M whole rows held in registers (one read of every input, one write of every output).
constexpr flags switch the sources (one matrix, its partial sums, a residual, three gathered table rows), the bias
add, the pre-norm-sum store, the GELU and the statistics (LayerNorm's, or RMSNorm's: no centring, no bias), so each op
compiles to exactly the code it needs. Two entry kernels share the body: `_norm_kernel` (LayerNorm) and
`_rms_norm_kernel` (RMSNorm, with only the arguments it uses and its own autotune key and name in profiles).

A row is held as NCHUNK column blocks of CHUNK (a power of two, as Triton's blocks must be): widths of 3 x 2^k
(384, 768, 1536, 3072: the encoders' hidden sizes) as three exact blocks, so no lane loads, computes or holds a
padding column, and the loads need no column mask; any other width as one block padded to the next power of two
(masked). A padded block spends its padding lanes' issue slots and registers on nothing (a quarter of them for 768
padded to 1024), and the GELU kernels are issue-bound (docs/decisions/0011-layer-norm-blocks-and-eviction-hints.md).

LayerNorm + GELU in a half type hints L2 eviction: the activations, read once, evict-first; the LayerNorm's weight
and bias, which every program reads, evict-last. Only there: the hints pay where the kernel is furthest from a copy
of the same bytes, and the other ops and fp32 keep the default because the hints did not pay for them (the
measurements: docs/decisions/0013-eviction-hints-for-layer-norm-gelu.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusedserve.kernels.triton._common import (as_rows, autotune, needs_wide, output_like, pdl_args, pdl_sync,
                                              row_bucket)
from fusedserve.kernels.triton._gelu import gelu


def column_chunks(cols: int) -> tuple[int, int]:
    """(NCHUNK, CHUNK) for a row of `cols`: three exact blocks for 3 x 2^k >= 48 columns, else one padded block."""
    third = cols // 3
    if cols % 3 == 0 and third >= 16 and third & (third - 1) == 0:
        return 3, third
    return 1, triton.next_power_of_2(cols)


def l2_policies(gelu_mode: int, dtype: torch.dtype) -> dict[str, str]:
    """The kernel's READ_ONCE / READ_SHARED eviction policies: hinted for LayerNorm + GELU in a half type only."""
    if gelu_mode and dtype in (torch.float16, torch.bfloat16):
        return {"READ_ONCE": "evict_first", "READ_SHARED": "evict_last"}
    return {"READ_ONCE": "", "READ_SHARED": ""}


def norm_configs(row: int, chunk: int) -> list[tuple[int, int]]:
    """(BLOCK_M, num_warps) candidates for rows of `row` elements held in blocks of `chunk`, the heuristic first:
    tiles of up to 2048 / 4096 / 16384 / 512 / 1024 elements, 16, 8 or 32 elements of a block per thread (16-byte
    vectors of a half type). Few warps over few rows first: many small programs keep more loads in flight than a few
    wide ones. One row of 768 or 1024 per program (the 512 / 1024 tiles) spreads a few-token batch over more SMs; the
    autotuner keeps whichever candidate is fastest per shape (docs/kernels.md, the bench results for figures)."""
    out = []
    for tile in (2048, 4096, 16384, 512, 1024):
        block_m = 1
        while block_m * 2 * row <= tile:
            block_m *= 2
        block_m = min(block_m, 4096)
        for per_thread in (16, 8, 32):
            warps = min(max(block_m * chunk // (32 * per_thread), 1), 16)
            if (block_m, warps) not in out:
                out.append((block_m, warps))
    return out


def _prune(configs, named_args, **kwargs):
    wanted = norm_configs(kwargs["NCHUNK"] * kwargs["CHUNK"], kwargs["CHUNK"])
    return [c for w in wanted for c in configs if (c.kwargs["BLOCK_M"], c.num_warps) == w]


_CONFIGS = [
    triton.Config({"BLOCK_M": 2**m}, num_warps=2**w)
    for m in range(13)  # BLOCK_M 1 .. 4096 (4096 rows only for single-column rows)
    for w in range(5)  # 1 .. 16 warps
]


@triton.jit
def _sum_block(X, x_rows, stride_p, R, r_rows, T, t_rows, BIAS, Y, cols, col_ok, mask, PARTS: tl.constexpr,
               SOURCES: tl.constexpr, HAS_BIAS: tl.constexpr, F64: tl.constexpr, ONCE: tl.constexpr,
               SHARED: tl.constexpr, RMS: tl.constexpr):
    """One column block of the rows' pre-norm sums, [BLOCK_M, CHUNK] in fp32 (fp64 for fp64), 0 outside `mask`;
    for RMSNorm with a residual, the sum as Y's dtype holds it (the residual stream, which transformers' decoders add
    in the model dtype before the norm). The loads are unrolled: independent, so in flight together (a runtime loop
    over a split GEMM's partial sums waits out one memory latency per part, which dominates a few-token batch's
    LayerNorm)."""
    h = tl.load(X + x_rows[:, None] + cols[None, :], mask=mask, other=0.0,
                eviction_policy=ONCE)
    h = h.to(tl.float64) if F64 else h.to(tl.float32)
    for part in tl.static_range(1, PARTS):  # the other partial products of a split GEMM, in a fixed order
        h += tl.load(X + part * stride_p + x_rows[:, None] + cols[None, :], mask=mask, other=0.0,
                     eviction_policy=ONCE).to(h.dtype)
    if SOURCES > 1:
        h += tl.load(R + r_rows[:, None] + cols[None, :], mask=mask, other=0.0,
                     eviction_policy=ONCE).to(h.dtype)
    if SOURCES > 2:
        h += tl.load(T + t_rows[:, None] + cols[None, :], mask=mask, other=0.0,
                     eviction_policy=ONCE).to(h.dtype)
    if HAS_BIAS:
        h += tl.load(BIAS + cols, mask=col_ok, other=0.0, eviction_policy=SHARED).to(h.dtype)[None, :]
    if RMS:
        if SOURCES > 1:
            h = h.to(Y.dtype.element_ty).to(h.dtype)
    return h


@triton.jit
def _store_block(c, rstd, W, B, Y, y_rows, cols, col_ok, mask, GELU: tl.constexpr, SHARED: tl.constexpr,
                 RMS: tl.constexpr):
    """y = (h - mean) * rstd * w + b [-> GELU] for one column block, `c` = h - mean; with RMS, y = w * (h * rstd)
    with h * rstd rounded to Y's dtype first (transformers' Qwen2/Qwen3 RMSNorm: the product of two fp16 or bf16
    values is exact in fp32, so the one rounding of the store is that of the product in the input dtype)."""
    w = tl.load(W + cols, mask=col_ok, other=0.0, eviction_policy=SHARED).to(c.dtype)
    if RMS:
        y = (c * rstd[:, None]).to(Y.dtype.element_ty).to(c.dtype) * w[None, :]
    else:
        b = tl.load(B + cols, mask=col_ok, other=0.0, eviction_policy=SHARED).to(c.dtype)
        y = gelu(c * rstd[:, None] * w[None, :] + b[None, :], GELU, Y.dtype.element_ty.primitive_bitwidth == 16)
    tl.store(Y + y_rows[:, None] + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _normalize_rows(X, R, T, IDX_X, IDX_R, IDX_T, BIAS, W, B, Y, S, stride_x, stride_r, stride_t, stride_y, stride_s,
                    stride_p, M, N, eps, PARTS: tl.constexpr, SOURCES: tl.constexpr, GATHER: tl.constexpr,
                    HAS_BIAS: tl.constexpr, STORE_SUM: tl.constexpr, GELU: tl.constexpr, RMS: tl.constexpr,
                    F64: tl.constexpr, WIDE: tl.constexpr, NCHUNK: tl.constexpr, CHUNK: tl.constexpr,
                    EVEN_COLS: tl.constexpr, READ_ONCE: tl.constexpr, READ_SHARED: tl.constexpr,
                    BLOCK_M: tl.constexpr, USE_PDL: tl.constexpr):
    """The body of both entry kernels (their arguments are documented at _norm_kernel); inlined into each."""
    pid = tl.program_id(0)
    if WIDE:  # offsets past 2^31 elements need 64-bit arithmetic; otherwise 32-bit is cheaper per element
        pid = pid.to(tl.int64)
        stride_p = stride_p.to(tl.int64)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = tl.arange(0, CHUNK)
    if EVEN_COLS:
        mask = row_ok[:, None]  # broadcast along the columns: the loads stay 16-byte vectors
    else:
        mask = row_ok[:, None] & (cols < N)[None, :]
    pdl_sync(USE_PDL)

    if GATHER:
        x_rows = tl.load(IDX_X + rows, mask=row_ok, other=0).to(tl.int64) * stride_x
        r_rows = tl.load(IDX_R + rows, mask=row_ok, other=0).to(tl.int64) * stride_r
        t_rows = tl.load(IDX_T + rows, mask=row_ok, other=0).to(tl.int64) * stride_t
    else:
        x_rows = rows * stride_x
        r_rows = rows * stride_r
        t_rows = rows * stride_t
    y_rows = rows * stride_y
    s_rows = rows * stride_s

    # LayerNorm: mean = sum(h) / N; var = sum((h - mean)^2) / N (the centered pass over registers: no E[h^2] - mean^2
    # cancellation, no re-read); y = (h - mean) / sqrt(var + eps) * w + b.
    # RMSNorm: the same without the centring and the bias: var = sum(h^2) / N; y = w * (h / sqrt(var + eps)), the
    # pre-norm sum rounded to the input dtype first (as transformers' decoders carry the residual stream)
    h0 = _sum_block(X, x_rows, stride_p, R, r_rows, T, t_rows, BIAS, Y, cols, cols < N, mask, PARTS, SOURCES,
                    HAS_BIAS, F64, READ_ONCE, READ_SHARED, RMS)
    if STORE_SUM:
        tl.store(S + s_rows[:, None] + cols[None, :], h0.to(S.dtype.element_ty), mask=mask)
    if NCHUNK > 1:
        # NCHUNK 3 only for exact widths: every column of these blocks is real
        h1 = _sum_block(X + CHUNK, x_rows, stride_p, R + CHUNK, r_rows, T + CHUNK, t_rows, BIAS + CHUNK, Y, cols,
                        cols < CHUNK, mask, PARTS, SOURCES, HAS_BIAS, F64, READ_ONCE, READ_SHARED, RMS)
        h2 = _sum_block(X + 2 * CHUNK, x_rows, stride_p, R + 2 * CHUNK, r_rows, T + 2 * CHUNK, t_rows,
                        BIAS + 2 * CHUNK, Y, cols, cols < CHUNK, mask, PARTS, SOURCES, HAS_BIAS, F64, READ_ONCE,
                        READ_SHARED, RMS)
        if STORE_SUM:
            tl.store(S + CHUNK + s_rows[:, None] + cols[None, :], h1.to(S.dtype.element_ty), mask=mask)
            tl.store(S + 2 * CHUNK + s_rows[:, None] + cols[None, :], h2.to(S.dtype.element_ty), mask=mask)
    if RMS:  # no centring; the padding columns hold 0
        c0 = h0
        if NCHUNK > 1:
            c1 = h1
            c2 = h2
    else:
        if NCHUNK == 1:
            total = tl.sum(h0, axis=1)
        else:
            total = tl.sum(h0 + h1 + h2, axis=1)
        mean = total / N
        if EVEN_COLS:
            c0 = h0 - mean[:, None]
        else:  # the padding columns hold 0, so the mean's sum needed no mask; the variance's does
            c0 = tl.where(mask, h0 - mean[:, None], 0.0)
        if NCHUNK > 1:
            c1 = h1 - mean[:, None]
            c2 = h2 - mean[:, None]
    if NCHUNK == 1:
        sq = tl.sum(c0 * c0, axis=1)
    else:
        sq = tl.sum(c0 * c0 + c1 * c1 + c2 * c2, axis=1)
    if F64:  # fp64 sqrt and division are correctly rounded (rsqrt is an approximation): the gradcheck's path
        rstd = 1.0 / tl.sqrt(sq / N + eps)
    else:
        rstd = tl.math.rsqrt(sq / N + eps)
    _store_block(c0, rstd, W, B, Y, y_rows, cols, cols < N, mask, GELU, READ_SHARED, RMS)
    if NCHUNK > 1:
        _store_block(c1, rstd, W + CHUNK, B + CHUNK, Y + CHUNK, y_rows, cols, cols < CHUNK, mask, GELU,
                     READ_SHARED, RMS)
        _store_block(c2, rstd, W + 2 * CHUNK, B + 2 * CHUNK, Y + 2 * CHUNK, y_rows, cols, cols < CHUNK, mask, GELU,
                     READ_SHARED, RMS)


@autotune(_CONFIGS, key=["N", "M_BUCKET", "SOURCES", "GATHER", "HAS_BIAS", "STORE_SUM", "GELU", "PARTS"],
          prune=_prune)
@triton.jit(do_not_specialize=["M", "M_BUCKET"])  # counts: see _common.autotune
def _norm_kernel(
    X,  # [M, N] input; with PARTS, [P, M, N] partial sums (summed in order); with GATHER, a table indexed by IDX_X
    R,  # [M, N] residual, or with GATHER a second table (unused unless SOURCES > 1)
    T,  # with GATHER, a third table (unused unless SOURCES > 2)
    IDX_X, IDX_R, IDX_T,  # [M] row ids into X, R, T (unused unless GATHER)
    BIAS,  # [N] bias added before the norm (unused unless HAS_BIAS)
    W,  # [N] LayerNorm weight
    B,  # [N] LayerNorm bias
    Y,  # [M, N] output
    S,  # [M, N] pre-norm sum output (unused unless STORE_SUM)
    stride_x, stride_r, stride_t, stride_y, stride_s,  # row strides; columns are unit-stride
    stride_p,  # with PARTS: the stride between X's partial sums
    M, N, eps,
    M_BUCKET,  # autotune key only
    PARTS: tl.constexpr,  # how many partial sums X holds (1: a plain [M, N] input)
    SOURCES: tl.constexpr,  # 1: X; 2: X + R; 3: X + R + T
    GATHER: tl.constexpr,  # the sources' rows are looked up by id (embedding_layer_norm)
    HAS_BIAS: tl.constexpr,
    STORE_SUM: tl.constexpr,
    GELU: tl.constexpr,
    F64: tl.constexpr,
    WIDE: tl.constexpr,
    NCHUNK: tl.constexpr,  # 1 or 3 column blocks (column_chunks)
    CHUNK: tl.constexpr,
    EVEN_COLS: tl.constexpr,  # NCHUNK * CHUNK == N: no column is padding
    READ_ONCE: tl.constexpr,  # L2 eviction policy of the activations' loads ("": the default; l2_policies)
    READ_SHARED: tl.constexpr,  # ... and of the weight and bias loads, which every program makes
    BLOCK_M: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # launched with programmatic dependent launch (_common.pdl_args)
):
    _normalize_rows(X, R, T, IDX_X, IDX_R, IDX_T, BIAS, W, B, Y, S, stride_x, stride_r, stride_t, stride_y, stride_s,
                    stride_p, M, N, eps, PARTS, SOURCES, GATHER, HAS_BIAS, STORE_SUM, GELU, False, F64, WIDE, NCHUNK,
                    CHUNK, EVEN_COLS, READ_ONCE, READ_SHARED, BLOCK_M, USE_PDL)


@autotune(_CONFIGS, key=["N", "M_BUCKET", "SOURCES", "STORE_SUM"], prune=_prune)
@triton.jit(do_not_specialize=["M", "M_BUCKET"])  # counts: see _common.autotune
def _rms_norm_kernel(
    X,  # [M, N] input
    R,  # [M, N] residual (unused unless SOURCES > 1)
    W,  # [N] RMSNorm weight
    Y,  # [M, N] output
    S,  # [M, N] pre-norm sum output (unused unless STORE_SUM)
    stride_x, stride_r, stride_y, stride_s,  # row strides; columns are unit-stride
    M, N, eps,
    M_BUCKET,  # autotune key only
    SOURCES: tl.constexpr,  # 1: X; 2: X + R
    STORE_SUM: tl.constexpr,
    F64: tl.constexpr,
    WIDE: tl.constexpr,
    NCHUNK: tl.constexpr,  # 1 or 3 column blocks (column_chunks)
    CHUNK: tl.constexpr,
    EVEN_COLS: tl.constexpr,  # NCHUNK * CHUNK == N: no column is padding
    BLOCK_M: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # launched with programmatic dependent launch (_common.pdl_args)
):
    # the LayerNorm body with RMS statistics: no partial sums, gathers, bias or GELU; W stands in for the unused
    # pointers, stride_x for the unused strides, and no eviction hints (they did not pay for the plain LayerNorm)
    _normalize_rows(X, R, X, W, W, W, W, W, W, Y, S, stride_x, stride_r, stride_x, stride_y, stride_s, stride_x,
                    M, N, eps, 1, SOURCES, False, False, STORE_SUM, 0, True, F64, WIDE, NCHUNK, CHUNK, EVEN_COLS,
                    "", "", BLOCK_M, USE_PDL)


def launch_norm(x: Tensor, residual: Tensor | None, bias: Tensor | None, weight: Tensor, ln_bias: Tensor,
                y: Tensor, pre_norm_sum: Tensor | None, eps: float, gelu_mode: int, parts: Tensor | None = None,
                gather: tuple[Tensor, Tensor, Tensor, Tensor] | None = None) -> None:
    """All tensors already validated: x, residual, y, pre_norm_sum are [M, N] with unit column stride. `parts`
    ([P, M, N], contiguous, x = parts[0]): the input is the sum of its P slices. `gather` (ids, pos, types, third
    table): y's rows are LayerNorm(x[ids] + residual[pos] + third[types]), x and residual being tables."""
    rows, cols = y.shape
    if rows == 0:
        return
    nchunk, chunk = column_chunks(cols)
    if gather is not None:
        ids, pos, types, third = gather
        sources = 3
    else:
        ids = pos = types = y
        third = x
        sources = 2 if residual is not None else 1

    def grid(meta):
        return (triton.cdiv(rows, meta["BLOCK_M"]),)

    _norm_kernel[grid](
        x, residual if residual is not None else x, third, ids, pos, types,
        bias if bias is not None else weight, weight, ln_bias, y, pre_norm_sum if pre_norm_sum is not None else y,
        x.stride(0), residual.stride(0) if residual is not None else 0, third.stride(0), y.stride(0),
        pre_norm_sum.stride(0) if pre_norm_sum is not None else 0,
        parts.stride(0) if parts is not None else 0,
        rows, cols, eps, row_bucket(rows), PARTS=parts.shape[0] if parts is not None else 1,
        SOURCES=sources, GATHER=gather is not None, HAS_BIAS=bias is not None, STORE_SUM=pre_norm_sum is not None,
        GELU=gelu_mode, F64=x.dtype == torch.float64,
        WIDE=needs_wide(y, pre_norm_sum) or (gather is None and needs_wide(x, residual))
        or (parts is not None and parts.numel() >= 2**31),
        NCHUNK=nchunk, CHUNK=chunk, EVEN_COLS=nchunk * chunk == cols, **l2_policies(gelu_mode, y.dtype),
        **pdl_args(y),
    )


def add_and_norm(name: str, x: Tensor, residual: Tensor, out: Tensor | None, return_sum: bool,
                 launch) -> Tensor | tuple[Tensor, Tensor]:
    """The add + norm launchers' frame (add_layer_norm, add_rms_norm): the residual shaped as x, both as [M, N] rows,
    the output (or `out`) and, with return_sum, the pre-norm sum's buffer; launch(x2, residual2, y, pre_norm_sum)
    runs the kernel. Returns y, or (y, the pre-norm sum) with return_sum."""
    if residual.shape != x.shape:
        raise ValueError(f"{name}: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    cols = x.shape[-1]
    x2 = as_rows(x, cols, name)
    y = output_like(x2, x.shape, out, name)
    pre_norm_sum = torch.empty_like(x2) if return_sum else None
    launch(x2, as_rows(residual, cols, f"{name} residual"), y, pre_norm_sum)
    y = out if out is not None else y.view(x.shape)
    return (y, pre_norm_sum.view(x.shape)) if return_sum else y


def launch_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, y: Tensor, pre_norm_sum: Tensor | None,
                    eps: float) -> None:
    """All tensors already validated: x, residual, y, pre_norm_sum are [M, N] with unit column stride. y = RMSNorm(x
    [+ residual]) in transformers' Qwen2/Qwen3 order; pre_norm_sum, if given, gets x + residual in its dtype."""
    rows, cols = y.shape
    if rows == 0:
        return
    nchunk, chunk = column_chunks(cols)

    def grid(meta):
        return (triton.cdiv(rows, meta["BLOCK_M"]),)

    _rms_norm_kernel[grid](
        x, residual if residual is not None else x, weight, y, pre_norm_sum if pre_norm_sum is not None else y,
        x.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0),
        pre_norm_sum.stride(0) if pre_norm_sum is not None else 0,
        rows, cols, eps, row_bucket(rows), SOURCES=2 if residual is not None else 1,
        STORE_SUM=pre_norm_sum is not None, F64=x.dtype == torch.float64,
        WIDE=needs_wide(y, pre_norm_sum) or needs_wide(x, residual),
        NCHUNK=nchunk, CHUNK=chunk, EVEN_COLS=nchunk * chunk == cols, **pdl_args(y),
    )
