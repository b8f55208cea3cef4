"""Triton GEMM with a bias + GELU epilogue: GELU(x @ weight^T + bias) in one kernel (a BERT layer's FFN-in).

Why: in a profile of BERT-base b32 s128 (docs/performance.md) the FFN-in GEMM is followed by a separate bias + GELU
pass that reads and writes the [tokens, 4 * hidden] activation again, a sizeable share of the forward.
Here the bias and the exact (erf) GELU run on the fp32 accumulator before the one store. cuBLASLt's GELU
epilogue is the tanh approximation, which is why this is a Triton GEMM rather than a cuBLAS flag.

In the registry as the Triton backend's `linear_bias_gelu` (the CUDA backend's is cuBLAS + its bias_gelu kernel):
the startup race at [4096, 4 x hidden] decides which one the encoder's FFN-in runs. `python -m bench kernels`
(scenario gemm-epilogues) measures it alone against cuBLAS + bias_gelu, eager torch, torch.compile and cuBLASLt's
tanh epilogue.

Tiles: the grouped ordering of Triton's matmul tutorial (GROUP_M row tiles share their weight tiles in L2);
configurations are the tutorial's Hopper/Ampere set, autotuned per (row class, N, K). fp32 inputs use IEEE fp32
products (no TF32: the fp32 tolerance is 1e-5), fp16/bf16 use tensor cores with fp32 accumulation. Tiles load
through pointers: a persistent TMA variant was no faster (docs/decisions/0002-tma-gemm-variant.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusedserve.kernels.triton._common import INTERPRET, autotune, check_device
from fusedserve.kernels.triton._gelu import GELU_MODES, gelu

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _config(m: int, n: int, k: int, stages: int, warps: int) -> triton.Config:
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_stages=stages,
                         num_warps=warps)


CONFIGS = [_config(*c) for c in (  # (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps)
    (128, 256, 64, 3, 8),  # the heuristic default (first): large FFN-in shapes on sm_90
    (64, 256, 32, 4, 4), (128, 128, 32, 4, 4), (128, 128, 64, 3, 8), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4),
    (64, 64, 64, 4, 4),
    (32, 64, 32, 5, 2),  # few rows (a single short request)
)]


def configs_within(configs, element_size: int, limit: int) -> list[triton.Config]:
    """The configurations whose pipelined A and B tiles (num_stages copies of each) fit `limit` bytes."""
    def need(c):
        m, n, k = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
        return (m * k + k * n) * c.num_stages * element_size

    return [c for c in configs if need(c) <= limit]


def _fits_shared_memory(configs, named_args, **kwargs):
    """Drop what does not fit the device's shared memory (fp32 with the largest tiles on any GPU; more of them on
    GPUs smaller than Hopper). The first survivor is the heuristic default, all that runs with
    FUSEDSERVE_TRITON_AUTOTUNE=0."""
    x = named_args["x_ptr"]
    if INTERPRET or x.device.type != "cuda":
        return list(configs)
    props = torch.cuda.get_device_properties(x.device)
    limit = getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024
    return configs_within(configs, x.element_size(), limit)


def row_class(m: int) -> int:
    """Autotune key for the row count: few rows (a single short request), a medium batch, a large one. Coarser
    than the norm kernels' power-of-two buckets: a GEMM autotune times 8 configurations, and serving's warm-up
    meets every row bucket (one class per bucket would add ~15 autotunes to the start-up)."""
    return 0 if m <= 64 else 1 if m <= 1024 else 2


@triton.jit
def _tile_position(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Tile number -> (row tile, column tile) in grouped order (Triton's matmul tutorial): GROUP_M row tiles walk
    the column tiles together, so their weight tiles are shared in L2."""
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = min(tiles_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_rows, (tile % per_group) // group_rows


@autotune(CONFIGS, key=["M_CLASS", "N", "K", "IEEE"], prune=_fits_shared_memory)
@triton.jit(do_not_specialize=["M", "M_CLASS"])  # counts: see _common.autotune
def _linear_gelu_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, M_CLASS,
                        stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
                        MODE: tl.constexpr, IEEE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile_position(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # int64 row/column offsets: M * stride can pass 2^31 for long packed batches
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :] * stride_xk
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk  # W^T tile [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        left = K - step * BLOCK_K
        a = tl.load(x_ptrs, mask=(rows[:, None] < M) & (ks[None, :] < left), other=0.0)
        b = tl.load(w_ptrs, mask=(ks[:, None] < left) & (cols[None, :] < N), other=0.0)
        if IEEE:  # fp32 inputs; and bf16 under the interpreter, whose bf16 dot is wrong (products are exact in fp32)
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    bias = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    h = gelu(acc + bias[None, :], MODE)
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :] * stride_yn
    tl.store(y_ptrs, h.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def _prepare(x: Tensor, weight: Tensor, bias: Tensor, approximate: str, out: Tensor | None):
    """Check the arguments and give x as [M, K] rows and the [M, N] output."""
    check_device("linear_bias_gelu", x, weight, bias)
    if x.dtype not in DTYPES or weight.dtype != x.dtype or bias.dtype != x.dtype:
        raise TypeError(f"linear_bias_gelu: x, weight and bias must share one of {DTYPES}, got "
                        f"{x.dtype}, {weight.dtype}, {bias.dtype}")
    if approximate not in GELU_MODES:
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    if weight.dim() != 2 or bias.shape != (weight.shape[0],) or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_bias_gelu: x {tuple(x.shape)}, weight {tuple(weight.shape)} and bias "
                         f"{tuple(bias.shape)} do not fit x @ weight^T + bias")
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    shape = (*x.shape[:-1], n)
    if out is None:
        return x2, torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if out.shape != shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"linear_bias_gelu: out must be a contiguous {x.dtype} tensor of shape {shape}")
    return x2, out.view(x2.shape[0], n)


def _ieee(dtype: torch.dtype) -> bool:
    # fp32 inputs take IEEE products; so does bf16 under the interpreter, whose bf16 dot is wrong
    return dtype == torch.float32 or (INTERPRET and dtype == torch.bfloat16)


def _launch_pointer(x2: Tensor, weight: Tensor, bias: Tensor, y: Tensor, approximate: str) -> None:
    (m, k), n = x2.shape, weight.shape[0]
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    _linear_gelu_kernel[grid](x2, weight, bias, y, m, n, k, row_class(m),
                              x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1),
                              y.stride(0), y.stride(1), MODE=GELU_MODES[approximate], IEEE=_ieee(x2.dtype))


def launch_config(config: triton.Config, x2: Tensor, weight: Tensor, bias: Tensor, y: Tensor,
                  approximate: str = "none") -> None:
    """One launch of the kernel with `config` (one of CONFIGS) instead of the autotuner's pick: x2 [M, K] rows,
    y [M, N] written. For checking and measuring each candidate on its own, not for serving."""
    (m, k), n = x2.shape, weight.shape[0]
    grid = (triton.cdiv(m, config.kwargs["BLOCK_M"]) * triton.cdiv(n, config.kwargs["BLOCK_N"]),)
    _linear_gelu_kernel.fn[grid](x2, weight, bias, y, m, n, k, row_class(m),
                                 x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1),
                                 y.stride(0), y.stride(1), MODE=GELU_MODES[approximate], IEEE=_ieee(x2.dtype),
                                 num_warps=config.num_warps, num_stages=config.num_stages, **config.kwargs)


def linear_bias_gelu(x: Tensor, weight: Tensor, bias: Tensor, approximate: str = "none", *,
                     out: Tensor | None = None) -> Tensor:
    """GELU(x @ weight^T + bias): x [..., K], weight [N, K] (nn.Linear's layout), bias [N] -> [..., N] in x's
    dtype. Any strides; `out` (contiguous, [..., N]) is written in place."""
    x2, y = _prepare(x, weight, bias, approximate, out)
    if y.numel():
        _launch_pointer(x2, weight, bias, y, approximate)
    return out if out is not None else y.view(*x.shape[:-1], weight.shape[0])
