"""Triton GEMM with a bias + residual + LayerNorm epilogue: LayerNorm(x @ weight^T + bias + residual) in one kernel
(a BERT layer's attention-out and FFN-out blocks).

Why: at a single short request (MiniLM b1 s16) every kernel of the forward is latency, and each of the 12
LayerNorms after the attention-out and FFN-out GEMMs is its own kernel (2.2-3.1 us plus a ~1 us boundary in the
CUDA graph; `bench/results/2026-11-30-h200-profile-minilm-b1.json`). Here the LayerNorm runs in the GEMM's epilogue.

The catch is that LayerNorm needs whole rows, and at 16 rows one program per row tile would stream the whole
weight through a single SM. So the GEMM is split over column tiles AND over K (programs = row tiles x column tiles x
K splits, tens of programs for 16 rows), and the pieces meet in two steps through a small fp32 workspace:
1. each program stores its partial [BLOCK_M, BLOCK_N] product and bumps a per-(row tile, column tile) counter; the
   last of the K splits to arrive sums the partials in a fixed order (deterministic, unlike fp32 atomics) and adds
   the bias and the residual;
2. it stores that tile of the pre-norm sum and bumps a per-row-tile counter; the last column tile to arrive
   normalizes the whole rows (mean, then the variance around it, from the workspace; fp32) and writes the output.
Ordering is CUTLASS's semaphore pattern: every thread's workspace stores, a CTA barrier, then one acquire-release
atomic; the winner reads the workspace past L1 (`.cg`). The winner also puts its counter back to zero, so the
counters (one persistent int32 buffer per device, zeroed once) are ready for the next launch and for CUDA-graph
replays. Launches on one device must therefore not run concurrently on two streams (the server runs one worker
stream; the registry's race and the tests are sequential).

Measured on the H200 (`python -m bench.linear_gelu --op linear_add_layer_norm`, against eager torch and
torch.compile in the same run): correct, deterministic, replays in CUDA graphs, and SLOWER than cuBLAS (F.linear) +
the Triton add_layer_norm kernel at every shape tried, 16 to 64 rows (docs/performance.md). One launch fewer does not
pay for the two counter round trips and the workspace reads through L2 at this size. So SMALL_ROWS is 0: the op runs
cuBLAS + add_layer_norm (two kernels, as before) unless a caller passes `small_rows`; the kernel stays for the bench
and as the starting point for a fused layer at small batches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.triton._common import INTERPRET, check_device
from kernels.triton.add_layer_norm import add_layer_norm

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# At most this many rows take the split kernel, more take cuBLAS + add_layer_norm. 0: the split kernel is off by
# default, because on the H200 it lost to cuBLAS + add_layer_norm at every shape measured (12.6 vs 9.7 us at
# MiniLM's attention-out for 16 tokens, 14.0 vs 12.1 at its FFN-out; bench/results/2026-11-30-h200-linear-layer-norm-s7.json)
SMALL_ROWS = 0
MAX_COLS = 8192  # widest row the split kernel takes (its last program walks the row in BLOCK_N tiles)
TARGET_PROGRAMS = 64  # K splits are chosen to give about this many programs
REDUCE_ELEMENTS = 8192  # fp32 values one program loads at once in the epilogue (registers: 64 per thread at 4 warps)
_COUNTERS = 4096  # row-tile and column-tile counters per device
_counters: dict[torch.device, Tensor] = {}


def _counter_buffer(device: torch.device) -> Tensor:
    """The device's zeroed counter buffer (every launch leaves it zeroed again). Created eagerly at the first
    launch: the registry's self-test and warm-up run before any CUDA-graph capture."""
    buf = _counters.get(device)
    if buf is None:
        buf = _counters[device] = torch.zeros(_COUNTERS, dtype=torch.int32, device=device)
    return buf


@triton.jit
def _linear_add_ln_kernel(x_ptr, w_ptr, b_ptr, r_ptr, g_ptr, beta_ptr, y_ptr, ws_ptr, cnt_ptr,
                          M, N, K, K_PER_SPLIT, eps,
                          stride_xm, stride_xk, stride_wn, stride_wk, stride_rm, stride_ym,
                          TILES_N: tl.constexpr, SPLIT_K: tl.constexpr, SPLIT_P2: tl.constexpr,
                          ROW: tl.constexpr, SUB_M: tl.constexpr, IEEE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    part = tl.program_id(1)  # column tile * SPLIT_K + K split
    tile_n = part // SPLIT_K
    split = part % SPLIT_K
    tiles_m = tl.num_programs(0)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    k_start = split * K_PER_SPLIT
    k_stop = tl.minimum(K, k_start + K_PER_SPLIT)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + (k_start + ks)[None, :] * stride_xk
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + (k_start + ks)[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_stop, BLOCK_K):
        left = k_stop - k
        a = tl.load(x_ptrs, mask=(rows[:, None] < M) & (ks[None, :] < left), other=0.0)
        b = tl.load(w_ptrs, mask=(ks[:, None] < left) & (cols[None, :] < N), other=0.0)
        if IEEE:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    # workspace (fp32): [tiles_m, TILES_N, SPLIT_P2, BLOCK_M, BLOCK_N] partial tiles, then the pre-norm sums as
    # whole rows, [tiles_m, BLOCK_M, ROW]. Every read below is one load of independent addresses (a loop of
    # dependent ones would pay an L2 round trip per step).
    TILE = BLOCK_M * BLOCK_N
    r_in = tl.arange(0, BLOCK_M)
    c_in = tl.arange(0, BLOCK_N)
    in_tile = r_in[:, None] * BLOCK_N + c_in[None, :]
    partials = ws_ptr + (pid_m * TILES_N + tile_n).to(tl.int64) * (SPLIT_P2 * TILE)
    sums = ws_ptr + tiles_m.to(tl.int64) * (TILES_N * SPLIT_P2 * TILE) + pid_m.to(tl.int64) * (BLOCK_M * ROW)
    column_counter = cnt_ptr + pid_m * TILES_N + tile_n
    row_counter = cnt_ptr + tiles_m * TILES_N + pid_m

    tl.store(partials + split * TILE + in_tile, acc)
    tl.debug_barrier()  # every thread's partial is stored before the release below
    if tl.atomic_add(column_counter, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
        # the last K split of this tile: sum the partials (one [SPLIT_P2, BLOCK_M, BLOCK_N] load, reduced in a fixed
        # order), add bias and residual
        tl.store(column_counter, 0)
        tl.debug_barrier()
        s_in = tl.arange(0, SPLIT_P2)
        parts = tl.load(partials + s_in[:, None, None] * TILE + in_tile[None, :, :],
                        mask=(s_in < SPLIT_K)[:, None, None], other=0.0, cache_modifier=".cg")
        total = tl.sum(parts, axis=0)
        col_ok = cols < N
        bias = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        ok = (rows[:, None] < M) & col_ok[None, :]
        res = tl.load(r_ptr + rows[:, None].to(tl.int64) * stride_rm + cols[None, :], mask=ok, other=0.0)
        total = tl.where(col_ok[None, :], total + bias[None, :] + res.to(tl.float32), 0.0)
        tl.store(sums + r_in[:, None] * ROW + cols[None, :], total)
        tl.debug_barrier()
        if tl.atomic_add(row_counter, 1, sem="acq_rel", scope="gpu") == TILES_N - 1:
            # the last column tile of this row tile: LayerNorm over whole rows, SUB_M rows per load
            tl.store(row_counter, 0)
            tl.debug_barrier()
            c = tl.arange(0, ROW)
            c_ok = c < N
            g = tl.load(g_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
            beta = tl.load(beta_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
            for r0 in range(0, BLOCK_M, SUB_M):
                sub = r0 + tl.arange(0, SUB_M)
                v = tl.load(sums + sub[:, None] * ROW + c[None, :], mask=c_ok[None, :], other=0.0,
                            cache_modifier=".cg")
                mean = tl.sum(v, axis=1) / N
                d = tl.where(c_ok[None, :], v - mean[:, None], 0.0)
                rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / N + eps)
                out = d * rstd[:, None] * g[None, :] + beta[None, :]
                out_rows = pid_m * BLOCK_M + sub
                tl.store(y_ptr + out_rows[:, None].to(tl.int64) * stride_ym + c[None, :],
                         out.to(y_ptr.dtype.element_ty), mask=(out_rows[:, None] < M) & c_ok[None, :])


def plan(m: int, n: int, k: int) -> dict:
    """Tile sizes and K split for the split kernel: 16-64 rows per tile, 64 columns, 64-deep K steps, and enough
    K splits for about TARGET_PROGRAMS programs, at most as many as keep the reducer's one load of every partial
    within 8192 fp32 values (and never an empty split)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k = 64, 64
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_steps = triton.cdiv(k, block_k)
    split = max(1, min(k_steps, TARGET_PROGRAMS // tiles, REDUCE_ELEMENTS // (block_m * block_n)))
    per_split = triton.cdiv(k_steps, split) * block_k
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": triton.cdiv(k, per_split),
            "K_PER_SPLIT": per_split}


def _prepare(x: Tensor, weight: Tensor, bias: Tensor, residual: Tensor, ln_weight: Tensor, ln_bias: Tensor,
             out: Tensor | None):
    name = "linear_add_layer_norm"
    check_device(name, x, weight, bias, residual, ln_weight, ln_bias)
    tensors = (x, weight, bias, residual, ln_weight, ln_bias)
    if x.dtype not in DTYPES or any(t.dtype != x.dtype for t in tensors):
        raise TypeError(f"{name}: all inputs must share one of {DTYPES}, got {', '.join(str(t.dtype) for t in tensors)}")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{name}: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit x @ weight^T")
    n, k = weight.shape
    shape = (*x.shape[:-1], n)
    if residual.shape != shape:
        raise ValueError(f"{name}: residual {tuple(residual.shape)} must have the output's shape {shape}")
    for label, v in (("bias", bias), ("ln_weight", ln_weight), ("ln_bias", ln_bias)):
        if v.shape != (n,):
            raise ValueError(f"{name}: {label} {tuple(v.shape)} must be ({n},)")
    if out is not None and (out.shape != shape or out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError(f"{name}: out must be a contiguous {x.dtype} tensor of shape {shape}")
    return x.reshape(-1, k), residual.reshape(-1, n), shape


def _ieee(dtype: torch.dtype) -> bool:
    # fp32 inputs take IEEE products; so does bf16 under the interpreter, whose bf16 dot is wrong
    return dtype == torch.float32 or (INTERPRET and dtype == torch.bfloat16)


def launch_split(x2: Tensor, weight: Tensor, bias: Tensor, r2: Tensor, ln_weight: Tensor, ln_bias: Tensor,
                 eps: float, y: Tensor, config: dict | None = None) -> None:
    """The split kernel on [M, K] rows into y [M, N] (contiguous)."""
    (m, k), n = x2.shape, weight.shape[0]
    p = config or plan(m, n, k)
    tiles_m, tiles_n = triton.cdiv(m, p["BLOCK_M"]), triton.cdiv(n, p["BLOCK_N"])
    counters = _counter_buffer(x2.device)
    if tiles_m * (tiles_n + 1) > counters.numel():
        raise ValueError(f"linear_add_layer_norm: {m} rows x {n} columns need more counters than the buffer holds")
    r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
    split_p2 = triton.next_power_of_2(p["SPLIT_K"])
    row = max(triton.next_power_of_2(n), p["BLOCK_N"])  # holds tiles_n * BLOCK_N columns
    tile = p["BLOCK_M"] * p["BLOCK_N"]
    workspace = torch.empty(tiles_m * (tiles_n * split_p2 * tile + p["BLOCK_M"] * row), dtype=torch.float32,
                            device=x2.device)
    _linear_add_ln_kernel[(tiles_m, tiles_n * p["SPLIT_K"])](
        x2, weight, bias, r2, ln_weight, ln_bias, y, workspace, counters, m, n, k, p["K_PER_SPLIT"], eps,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), r2.stride(0), y.stride(0),
        TILES_N=tiles_n, SPLIT_K=p["SPLIT_K"], SPLIT_P2=split_p2, ROW=row,
        SUB_M=min(p["BLOCK_M"], max(1, REDUCE_ELEMENTS // row)), IEEE=_ieee(x2.dtype),
        BLOCK_M=p["BLOCK_M"], BLOCK_N=p["BLOCK_N"], BLOCK_K=p["BLOCK_K"], num_warps=4, num_stages=3)


def linear_add_layer_norm(x: Tensor, weight: Tensor, bias: Tensor, residual: Tensor, ln_weight: Tensor,
                          ln_bias: Tensor, eps: float = 1e-12, *, out: Tensor | None = None,
                          small_rows: int | None = None) -> Tensor:
    """LayerNorm(x @ weight^T + bias + residual) over the last dimension: x [..., K], weight [N, K] (nn.Linear's
    layout), bias / ln_weight / ln_bias [N], residual [..., N] -> [..., N] in x's dtype. Up to `small_rows` rows
    (default SMALL_ROWS, 0: never) the split kernel; more rows: cuBLAS + the add_layer_norm kernel."""
    x2, r2, shape = _prepare(x, weight, bias, residual, ln_weight, ln_bias, out)
    m, n = x2.shape[0], weight.shape[0]
    limit = SMALL_ROWS if small_rows is None else small_rows
    if m > limit or n > MAX_COLS or x2.shape[1] == 0:
        return add_layer_norm(torch.nn.functional.linear(x, weight), residual, bias, ln_weight, ln_bias, eps, out=out)
    y = out.view(m, n) if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        launch_split(x2, weight, bias, r2, ln_weight, ln_bias, eps, y)
    return out if out is not None else y.view(shape)
