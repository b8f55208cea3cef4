"""Triton SPLADE pooling: max over each packed sequence's tokens of log1p(relu(x @ weight^T + bias)) in one kernel, a
vocab-tiled GEMM whose epilogue keeps the per-sequence max (SPLADE's sparse embeddings from the MLM head).

Why: unfused, the [tokens, vocab] logits are written (16384 x 30522 in fp16 is 1 GB), read back for the activation,
written again and read once more for the max: several times the memory traffic of the GEMM's inputs, and a peak
allocation that caps the batch. Here a program computes one [vocab tile, token tile] block of the logits in fp32
registers, adds the bias, reduces it over the rows of each sequence the token tile meets and merges that into the
[sequences, vocab] output with an atomic max: the logits are never written.

- Monotone: log1p(relu(.)) is non-decreasing, so the max of the activations is the activation of the max. The tile's
  max is taken on relu(logits) and log1p applied once per (sequence, column) before the atomic; the output starts at
  zero (the launcher zeroes it), which is relu's floor, so an empty sequence gives 0 and the merge is exact.
- The atomic is an integer max on the float bit patterns: for floats >= 0 the int32 order is the float order, and a
  NaN logit is made the canonical NaN 0x7FC00000, above +inf's pattern, so a NaN wins every merge and the output is
  NaN exactly where the reference's is (Triton's float atomic max splits by sign into a signed max and an unsigned
  min, and can drop a NaN; this is one integer atomic). Merging the same values again changes nothing, so the
  autotuner's repeated launches into the one output leave it correct (at worst the larger of two candidates' fp32
  roundings of a logit, which differ in the last bits if at all).
- The product is computed transposed, logits^T = W x^T as a [BLOCK_N, BLOCK_M] tile (vocab rows, token columns):
  the reduction over tokens then runs along the accumulator's rows, within a warp (a quad's shuffles on Hopper's
  wgmma layout), not across warps through shared memory.
- Sequences: a token tile finds the sequence of its first real row by a binary search of cu_seqlens (log2 B scalar
  loads, no table, nothing on the host: it runs inside CUDA graphs), then walks the sequences it meets. Tiles past
  the last offset (a CUDA-graph bucket's filler tokens) run no GEMM, and no filler row is ever read.
- Tiles, ordering and precision as linear_gelu.py: the grouped order of Triton's matmul tutorial (GROUP_M token tiles
  walk the vocab tiles together, so a weight tile is read once from memory for GROUP_M of them), autotuned per (row
  class, sequence-length class, V, H); IEEE fp32 products for fp32 inputs, tensor cores with fp32 accumulation in fp16 and bf16: the logits
  are not rounded to the input dtype (the reference's cuBLAS GEMM rounds them). Launched without programmatic
  dependent launch, as linear_gelu: a GEMM-bound kernel, whose waiting programs would hold their shared memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from fusedserve.kernels._layout import offsets
from fusedserve.kernels.triton._common import INTERPRET, autotune, check_device
from fusedserve.kernels.triton.linear_gelu import _tile_position, row_class
from fusedserve.kernels.triton.qkv_attention import _dot  # IEEE: fp32 products of the operands made fp32

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_NAN_BITS = tl.constexpr(0x7FC00000)  # the canonical fp32 NaN: as an int32, above every other non-negative float
_INF_BITS = tl.constexpr(0x7F800000)  # +inf
_LIBDEVICE = tl.constexpr(not INTERPRET)  # the interpreter has no libdevice


def _config(m: int, n: int, k: int, stages: int, warps: int) -> triton.Config:
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_stages=stages,
                         num_warps=warps)


# BLOCK_M tokens x BLOCK_N vocab columns x BLOCK_K hidden per step. The vocab is the wgmma's M side (up to two
# warpgroups of 64-row slabs), the tokens its N side. The default is linear_gelu's 128 x 256 x 64 tile with the roles
# of its sides exchanged (256 vocab columns: 30522 = 119 tiles and a ragged one); the others trade tile size for
# programs at few tokens, and 256 tokens a tile halves the weight reads of long sequences.
CONFIGS = [_config(*c) for c in (  # (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps)
    (128, 256, 64, 3, 8),  # the heuristic default (first): a large batch on sm_90
    (256, 128, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 64, 4, 4), (64, 256, 64, 4, 8), (64, 128, 64, 4, 4),
    (64, 64, 64, 4, 4),
    (32, 64, 32, 5, 2),  # few rows (a single short request)
)]


def shared_bytes(config: triton.Config, element_size: int) -> int:
    """The pipelined tiles of a configuration: num_stages copies of the weight tile and of the x tile."""
    m, n, k = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"]
    return (n * k + k * m) * config.num_stages * element_size


def configs_within(configs, element_size: int, limit: int) -> list[triton.Config]:
    """The configurations whose pipelined tiles fit `limit` bytes."""
    return [c for c in configs if shared_bytes(c, element_size) <= limit]


def length_class(tokens: int, sequences: int) -> int:
    """Autotune key for the tokens per sequence (filler tokens counted, all the host knows without a sync): short
    sequences (queries) put several into each token tile, and each costs the epilogue a pass over the tile, so their
    best tile has fewer tokens than long ones' (docs/kernels.md, splade_pool)."""
    return 0 if tokens < 64 * max(sequences, 1) else 1


def _fits_shared_memory(configs, named_args, **kwargs):
    """Drop what does not fit the device's shared memory (fp32 with the largest tiles on any GPU). The first survivor
    is the heuristic default, all that runs with FUSEDSERVE_TRITON_AUTOTUNE=0."""
    x = named_args["x_ptr"]
    if INTERPRET or x.device.type != "cuda":
        return list(configs)
    props = torch.cuda.get_device_properties(x.device)
    limit = getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024
    return configs_within(configs, x.element_size(), limit)


@triton.jit
def _offset(cu_ptr, i, M):
    """cu_seqlens[i] clamped to [0, M], as int32 (M < 2^31 rows)."""
    return tl.minimum(tl.maximum(tl.load(cu_ptr + i), 0), M).to(tl.int32)


@triton.jit
def _log1p(x):
    """log(1 + x) for x >= 0 (+inf included): libdevice's; on the interpreter Kahan's log(u) * x / (u - 1) with
    u = 1 + x rounded, the quotient correcting u's rounding (x where u rounds to 1)."""
    if _LIBDEVICE:
        return libdevice.log1p(x)
    else:
        u = 1.0 + x
        d = u - 1.0
        y = tl.where(d == 0.0, x, tl.log(u) * (x / tl.where(d == 0.0, 1.0, d)))
        return tl.where(x == float("inf"), x, y)


@autotune(CONFIGS, key=["M_CLASS", "L_CLASS", "N", "K", "IEEE"], prune=_fits_shared_memory)
@triton.jit(do_not_specialize=["M", "B", "M_CLASS", "L_CLASS"])  # counts: see _common.autotune
def _splade_pool_kernel(x_ptr,  # [M, K] hidden states: the packed sequences' rows
                        w_ptr,  # [N, K] weight (one row per vocab entry)
                        b_ptr,  # [N] bias (read only with HAS_BIAS)
                        cu_ptr,  # [B + 1] int32/int64 sequence offsets
                        y_ptr,  # [B, N] the output's fp32 bit patterns as int32, zeroed before the launch
                        M, N, K, B, M_CLASS, L_CLASS,
                        stride_xm, stride_xk, stride_wn, stride_wk, stride_b, stride_y,
                        HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile_position(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    # the tile's real rows: [start, end), its rows within [cu[0], cu[B]) (rows outside are filler, never read)
    first = pid_m * BLOCK_M
    start = tl.maximum(first, _offset(cu_ptr, 0, M))
    end = tl.minimum(first + BLOCK_M, _offset(cu_ptr, B, M))
    rows = first + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    real = (rows >= start) & (rows < end)
    # logits^T tile [BLOCK_N, BLOCK_M] = W tile [BLOCK_N, BLOCK_K] @ x^T tile [BLOCK_K, BLOCK_M]; int64 row offsets
    # (M * stride can pass 2^31 for long packed batches, N * stride for a large vocab)
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :] * stride_wk
    x_ptrs = x_ptr + rows[None, :].to(tl.int64) * stride_xm + ks[:, None] * stride_xk
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for step in range(0, tl.where(start < end, tl.cdiv(K, BLOCK_K), 0)):  # no GEMM for a tile of filler rows
        left = K - step * BLOCK_K
        w = tl.load(w_ptrs, mask=(cols[:, None] < N) & (ks[None, :] < left), other=0.0)
        xt = tl.load(x_ptrs, mask=real[None, :] & (ks[:, None] < left), other=0.0)
        # IEEE: fp32 inputs, and bf16 under the interpreter (its bf16 dot is wrong)
        acc = _dot(w, xt, acc, IEEE)
        w_ptrs += BLOCK_K * stride_wk
        x_ptrs += BLOCK_K * stride_xk
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols * stride_b, mask=cols < N, other=0.0).to(tl.float32)[:, None]
    # relu(logit) as its fp32 bit pattern, NaN as the canonical NaN: an int32 max of these is the float max that
    # propagates NaN (every value is >= 0, where the two orders agree)
    bits = tl.where(acc > 0.0, acc, 0.0).to(tl.int32, bitcast=True)
    bits = tl.where(acc != acc, _NAN_BITS, bits)

    # the sequence of the tile's first real row: the last b < B with cu[b] <= start (offsets non-decreasing)
    lo = B * 0
    hi = B - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        below = _offset(cu_ptr, mid, M) <= start
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid - 1)
    # then each sequence the tile meets, from there on
    seq = lo
    seq_start = _offset(cu_ptr, seq, M)
    while (seq < B) & (seq_start < end):
        seq_end = tl.maximum(_offset(cu_ptr, seq + 1, M), seq_start)
        lower, upper = tl.maximum(seq_start, start), tl.minimum(seq_end, end)
        # max over the sequence's rows in this tile, then log1p once: log1p(max) = max(log1p), log1p monotone
        peak = tl.max(tl.where((rows[None, :] >= lower) & (rows[None, :] < upper), bits, 0), axis=1)  # [BLOCK_N]
        value = _log1p(peak.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)
        value = tl.where(peak > _INF_BITS, _NAN_BITS, value)
        tl.atomic_max(y_ptr + seq.to(tl.int64) * stride_y + cols, value, mask=(cols < N) & (lower < upper),
                      sem="relaxed")
        seq += 1
        seq_start = seq_end


def _prepare(x: Tensor, weight: Tensor, bias: Tensor | None, cu_seqlens: Tensor, out: Tensor | None):
    """Check the arguments; the offsets contiguous and the [B, V] float32 output (fresh, or the caller's `out`)."""
    check_device("splade_pool", x, weight, bias)
    cu_seqlens = offsets("splade_pool", x, cu_seqlens)
    if x.dtype not in DTYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(f"splade_pool: x, weight and bias must share one of {DTYPES}, got "
                        f"{x.dtype}, {weight.dtype}, {None if bias is None else bias.dtype}")
    if weight.dim() != 2 or x.shape[1] != weight.shape[1] or (bias is not None and bias.shape != (weight.shape[0],)):
        raise ValueError(f"splade_pool: x {tuple(x.shape)}, weight {tuple(weight.shape)} and bias "
                         f"{None if bias is None else tuple(bias.shape)} do not fit x @ weight^T + bias with x [T, H], "
                         "weight [V, H] and bias [V]")
    shape = (cu_seqlens.numel() - 1, weight.shape[0])
    if out is None:
        return cu_seqlens, torch.empty(shape, dtype=torch.float32, device=x.device)
    if out.shape != shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"splade_pool: out must be a contiguous torch.float32 tensor of shape {shape}")
    return cu_seqlens, out


def _ieee(dtype: torch.dtype) -> bool:
    # fp32 inputs take IEEE products; so does bf16 under the interpreter, whose bf16 dot is wrong
    return dtype == torch.float32 or (INTERPRET and dtype == torch.bfloat16)


def _arguments(x: Tensor, weight: Tensor, bias: Tensor | None, cu_seqlens: Tensor, y: Tensor) -> tuple[tuple, dict]:
    (m, k), (segments, n) = x.shape, y.shape
    # without a bias the kernel never reads b_ptr: the weight stands in for it
    args = (x, weight, weight if bias is None else bias, cu_seqlens, y.view(torch.int32), m, n, k, segments,
            row_class(m), length_class(m, segments), x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
            0 if bias is None else bias.stride(0), y.stride(0))
    return args, {"HAS_BIAS": bias is not None, "IEEE": _ieee(x.dtype)}


def launch_config(config: triton.Config, x: Tensor, weight: Tensor, bias: Tensor | None, cu_seqlens: Tensor,
                  y: Tensor) -> None:
    """One launch of the kernel with `config` (one of CONFIGS) instead of the autotuner's pick, y [B, V] float32
    zeroed first and written. For checking and measuring each candidate on its own, not for serving."""
    cu_seqlens, y = _prepare(x, weight, bias, cu_seqlens, y)
    y.zero_()
    args, constexprs = _arguments(x, weight, bias, cu_seqlens, y)
    m, n = x.shape[0], y.shape[1]
    grid = (triton.cdiv(m, config.kwargs["BLOCK_M"]) * triton.cdiv(n, config.kwargs["BLOCK_N"]),)
    _splade_pool_kernel.fn[grid](*args, **constexprs, num_warps=config.num_warps, num_stages=config.num_stages,
                                 **config.kwargs)


def splade_pool(x: Tensor, weight: Tensor, bias: Tensor | None, cu_seqlens: Tensor, *,
                out: Tensor | None = None) -> Tensor:
    """out[b, v] = max over the rows t of sequence b of log1p(relu(x[t] @ weight[v] + bias[v])): x [T, H] (any
    strides), weight [V, H] (nn.Linear's layout, any strides), bias [V] or None, non-decreasing offsets cu_seqlens
    [B + 1] int32/int64 on x's device -> [B, V] float32 (an empty sequence gives zeros; rows outside
    [cu_seqlens[0], cu_seqlens[B]) are never read; offsets are clamped to [0, T]). `out` (contiguous [B, V] float32)
    is written in place."""
    cu_seqlens, y = _prepare(x, weight, bias, cu_seqlens, out)
    if y.numel():
        y.zero_()  # relu's floor and an empty sequence's result; the kernel merges into it
        if x.shape[0]:
            args, constexprs = _arguments(x, weight, bias, cu_seqlens, y)
            m, n = x.shape[0], y.shape[1]
            grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
            _splade_pool_kernel[grid](*args, **constexprs)
    return y
