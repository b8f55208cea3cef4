"""Triton GEMM with a gated-linear-unit epilogue: act(x @ Wa^T + ba) * (x @ Wb^T + bb) in one kernel (a gated
feed-forward's first GEMM: GTE's and ModernBERT's GeGLU, NomicBERT's SwiGLU).

Why: unfused, the [tokens, 2I] projection is written, read back for the activation and the product, and the
[tokens, I] result written again. Here each program accumulates the activated half's tile and the other half's tile
of the same columns side by side, both fed by the same x tile, and applies the bias, the activation and the product to
the fp32 accumulators before the one store: the gate is never written to memory.

The weight is nn.Linear's [2I, K] with the activated rows first (weight = [Wa; Wb]), as the models stack their two
projections. Tiles, ordering and precision follow linear_gelu.py (the grouped ordering of Triton's matmul tutorial,
autotuned per (row class, I, K), IEEE fp32 products for fp32 inputs, tensor cores with fp32 accumulation in fp16 and
bf16). Launched without programmatic dependent launch, as linear_gelu: it serves the GEMM-bound batches, where a
waiting program would sit on its shared memory while the previous kernel finishes; PDL is the few-token chain's.
On sm_90, half-precision batches of TMA_MIN_ROWS rows and more take a second kernel of the same arithmetic whose
tiles arrive by TMA on a persistent grid (below, and docs/decisions/0019-linear-glu-by-tma.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from fusedserve.kernels.triton._common import INTERPRET, autotune, check_device, deferrable
from fusedserve.kernels.triton._gelu import GELU_MODES, gelu
from fusedserve.kernels.triton.linear_gelu import _tile_position, row_class
from fusedserve.kernels.triton.qkv_attention import _dot  # IEEE: fp32 products of the operands made fp32

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ACTIVATIONS = {"gelu": 0, "silu": 1}  # the op's `activation` -> the kernel's ACT (kernels.reference.GLU_ACTIVATIONS)
_GELU_EXACT = tl.constexpr(GELU_MODES["none"])


def _config(m: int, n: int, k: int, stages: int, warps: int) -> triton.Config:
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_stages=stages,
                         num_warps=warps)


# linear_gelu's candidates with BLOCK_N halved. A program here holds two weight tiles [BLOCK_K, BLOCK_N] per K step
# (Wa's and Wb's) and two fp32 accumulators [BLOCK_M, BLOCK_N]: at half the output columns it has exactly
# linear_gelu's shared memory per pipeline stage, accumulator registers and MMA work per K step (it computes a
# [BLOCK_M, 2 x BLOCK_N] tile of the [T, 2I] product), so the same warps and stages fit. At linear_gelu's BLOCK_N the
# default 128 x 256 x 64 tile would need 2 x 128 KB of accumulators in registers (spilled) and 240 KB of pipelined
# tiles, more than any GPU's shared memory.
CONFIGS = [_config(*c) for c in (  # (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps)
    (128, 128, 64, 3, 8),  # the heuristic default (first): large FFN-in shapes on sm_90
    (64, 128, 32, 4, 4), (128, 64, 32, 4, 4), (128, 64, 64, 3, 8), (128, 32, 32, 4, 4), (64, 64, 32, 4, 4),
    (64, 32, 64, 4, 4),
    (32, 32, 32, 5, 2),  # few rows (a single short request)
)]


def shared_bytes(config: triton.Config, element_size: int) -> int:
    """The pipelined tiles of a configuration: num_stages copies of the x tile and of the two weight tiles."""
    m, n, k = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"]
    return (m * k + 2 * k * n) * config.num_stages * element_size


def configs_within(configs, element_size: int, limit: int) -> list[triton.Config]:
    """The configurations whose pipelined tiles fit `limit` bytes."""
    return [c for c in configs if shared_bytes(c, element_size) <= limit]


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


@triton.jit
def _gated(acc_a, acc_b, b_ptr, cols, N, ACT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The epilogue on the fp32 accumulators of the output columns `cols`: act(a + ba) * (b + bb)."""
    if HAS_BIAS:
        acc_a += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        acc_b += tl.load(b_ptr + N + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if ACT == 0:
        # GeGLU: a * Phi(a), the exact (erf) GELU in its five-term form (the time is the matmul's)
        gate = gelu(acc_a, _GELU_EXACT)
    else:
        # SwiGLU: silu(a) = a / (1 + exp(-a)); at a = -inf, -inf / inf = NaN, as the reference gives
        gate = acc_a / (1.0 + tl.exp(-acc_a))
    return gate * acc_b


@autotune(CONFIGS, key=["M_CLASS", "N", "K", "IEEE"], prune=_fits_shared_memory)
@triton.jit(do_not_specialize=["M", "M_CLASS"])  # counts: see _common.autotune
def _linear_glu_kernel(x_ptr,  # [M, K] activations
                       w_ptr,  # [2N, K] weight: Wa (activated) in rows 0..N-1, Wb in rows N..2N-1
                       b_ptr,  # [2N] bias, ba then bb (read only with HAS_BIAS)
                       y_ptr,  # [M, N] output
                       M, N, K, M_CLASS,
                       stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
                       ACT: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile_position(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # int64 row/column offsets: M * stride can pass 2^31 for long packed batches
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :] * stride_xk
    # Wa^T and Wb^T tiles [BLOCK_K, BLOCK_N] of the same output columns: weight rows n and N + n
    wa_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk
    wb_ptrs = w_ptr + (cols[None, :] + N).to(tl.int64) * stride_wn + ks[:, None] * stride_wk
    acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        left = K - step * BLOCK_K
        w_mask = (ks[:, None] < left) & (cols[None, :] < N)
        x = tl.load(x_ptrs, mask=(rows[:, None] < M) & (ks[None, :] < left), other=0.0)
        wa = tl.load(wa_ptrs, mask=w_mask, other=0.0)
        wb = tl.load(wb_ptrs, mask=w_mask, other=0.0)
        # the one x tile feeds both products; IEEE: fp32 inputs, and bf16 under the interpreter (its bf16 dot is wrong)
        acc_a = _dot(x, wa, acc_a, IEEE)
        acc_b = _dot(x, wb, acc_b, IEEE)
        x_ptrs += BLOCK_K * stride_xk
        wa_ptrs += BLOCK_K * stride_wk
        wb_ptrs += BLOCK_K * stride_wk
    y = _gated(acc_a, acc_b, b_ptr, cols, N, ACT, HAS_BIAS)
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :] * stride_yn
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


# On sm_90 the half-precision GEMM-bound batches take this kernel instead: the x and weight tiles arrive by TMA (the
# tensor memory accelerator copies a tile into shared memory without the warps computing its addresses, and Triton
# pipelines those copies under the tensor-core products), and a persistent grid of one program per SM walks the output
# tiles in the grouped order, so one tile's epilogue overlaps the next one's first loads. The same products and
# epilogue as above. Rules, not autotuning: the one tile below won at every FFN-in shape measured, with or without
# persistence (docs/decisions/0019-linear-glu-by-tma.md).
TMA_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_stages": 3, "num_warps": 8}
TMA_MIN_ROWS = 512  # fewer rows leave most SMs without a 128-row tile: the autotuned kernel's smaller tiles serve them


@deferrable
@triton.jit(do_not_specialize=["M"])
def _linear_glu_tma_kernel(x_desc, w_desc, y_desc, b_ptr, M, N, K, PROGRAMS: tl.constexpr,
                           ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS):
        pid_m, pid_n = _tile_position(tile, tiles_m, tiles_n, GROUP_M)
        first_row = pid_m * BLOCK_M
        first_col = pid_n * BLOCK_N
        acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            # TMA fills what lies outside the tensors with zeros; Wa rows past N (the last column tile of an I that
            # BLOCK_N does not divide) read Wb's first rows, columns that the store below leaves out
            x = x_desc.load([first_row, k])
            acc_a = tl.dot(x, w_desc.load([first_col, k]).T, acc_a)
            acc_b = tl.dot(x, w_desc.load([N + first_col, k]).T, acc_b)
        cols = first_col + tl.arange(0, BLOCK_N)
        y = _gated(acc_a, acc_b, b_ptr, cols, N, ACT, HAS_BIAS)
        y_desc.store([first_row, first_col], y.to(y_desc.dtype))  # clipped at the tensor's edges


def _prepare(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str, out: Tensor | None):
    """Check the arguments and give x as [M, K] rows and the [M, I] output."""
    check_device("linear_glu", x, weight, bias)
    if activation not in ACTIVATIONS:
        raise ValueError(f"linear_glu: activation {activation!r}; supported: {', '.join(ACTIVATIONS)}")
    if x.dtype not in DTYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(f"linear_glu: x, weight and bias must share one of {DTYPES}, got "
                        f"{x.dtype}, {weight.dtype}, {None if bias is None else bias.dtype}")
    if (weight.dim() != 2 or weight.shape[0] % 2 or x.shape[-1] != weight.shape[1]
            or (bias is not None and bias.shape != (weight.shape[0],))):
        raise ValueError(f"linear_glu: x {tuple(x.shape)}, weight {tuple(weight.shape)} and bias "
                         f"{None if bias is None else tuple(bias.shape)} do not fit x @ weight^T + bias with weight "
                         "[2I, K] and bias [2I]")
    n, k = weight.shape[0] // 2, weight.shape[1]
    x2 = x.reshape(-1, k)
    shape = (*x.shape[:-1], n)
    if out is None:
        return x2, torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if out.shape != shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"linear_glu: out must be a contiguous {x.dtype} tensor of shape {shape}")
    return x2, out.view(x2.shape[0], n)


def _ieee(dtype: torch.dtype) -> bool:
    # fp32 inputs take IEEE products; so does bf16 under the interpreter, whose bf16 dot is wrong
    return dtype == torch.float32 or (INTERPRET and dtype == torch.bfloat16)


def _arguments(x2: Tensor, weight: Tensor, bias: Tensor | None, y: Tensor, activation: str) -> tuple[tuple, dict]:
    (m, k), n = x2.shape, weight.shape[0] // 2
    # without a bias the kernel never reads b_ptr: the weight stands in for it
    args = (x2, weight, weight if bias is None else bias, y, m, n, k, row_class(m),
            x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1))
    return args, {"ACT": ACTIVATIONS[activation], "HAS_BIAS": bias is not None, "IEEE": _ieee(x2.dtype)}


def launch_config(config: triton.Config, x2: Tensor, weight: Tensor, bias: Tensor | None, y: Tensor,
                  activation: str = "gelu") -> None:
    """One launch of the kernel with `config` (one of CONFIGS) instead of the autotuner's pick: x2 [M, K] rows,
    y [M, I] written. For checking and measuring each candidate on its own, not for serving."""
    args, constexprs = _arguments(x2, weight, bias, y, activation)
    m, n = y.shape
    grid = (triton.cdiv(m, config.kwargs["BLOCK_M"]) * triton.cdiv(n, config.kwargs["BLOCK_N"]),)
    _linear_glu_kernel.fn[grid](*args, **constexprs, num_warps=config.num_warps, num_stages=config.num_stages,
                                **config.kwargs)


def _tma_ready(t: Tensor) -> bool:
    """What a TMA descriptor asks of a 2-D tensor: rows contiguous, the base and the row stride 16-byte aligned."""
    return t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def _takes_tma(x2: Tensor, weight: Tensor, y: Tensor) -> bool:
    """The TMA kernel's batches: half precision on a CUDA GPU with TMA (sm_90 on), enough rows, aligned tensors."""
    return (not INTERPRET and x2.is_cuda and x2.dtype in (torch.float16, torch.bfloat16)
            and x2.shape[0] >= TMA_MIN_ROWS and torch.cuda.get_device_capability(x2.device) >= (9, 0)
            and all(map(_tma_ready, (x2, weight, y))))


def launch_tma(x2: Tensor, weight: Tensor, bias: Tensor | None, y: Tensor, activation: str = "gelu") -> None:
    """The TMA kernel on x2 [M, K] rows into y [M, I] (fp16/bf16, _tma_ready tensors): the op's own path on sm_90 at
    TMA_MIN_ROWS rows and more, and the tests' way to run it anywhere (the interpreter runs its descriptors too)."""
    (m, k), n = x2.shape, y.shape[1]
    c = TMA_CONFIG
    tiles = triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"])
    sms = torch.cuda.get_device_properties(x2.device).multi_processor_count if x2.is_cuda else 4
    programs = min(tiles, sms)
    _linear_glu_tma_kernel[(programs,)](
        TensorDescriptor.from_tensor(x2, [c["BLOCK_M"], c["BLOCK_K"]]),
        TensorDescriptor.from_tensor(weight, [c["BLOCK_N"], c["BLOCK_K"]]),
        TensorDescriptor.from_tensor(y, [c["BLOCK_M"], c["BLOCK_N"]]),
        weight if bias is None else bias, m, n, k, PROGRAMS=programs, ACT=ACTIVATIONS[activation],
        HAS_BIAS=bias is not None, **c)


def linear_glu(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str = "gelu", *,
               out: Tensor | None = None) -> Tensor:
    """act(x @ Wa^T + ba) * (x @ Wb^T + bb): x [..., K], weight [2I, K] = [Wa; Wb] (nn.Linear's layout, the activated
    rows first), bias [2I] or None -> [..., I] in x's dtype; activation "gelu" (exact erf) or "silu". Any strides;
    `out` (contiguous, [..., I]) is written in place."""
    x2, y = _prepare(x, weight, bias, activation, out)
    if y.numel() and _takes_tma(x2, weight, y):
        launch_tma(x2, weight, bias, y, activation)
    elif y.numel():
        args, constexprs = _arguments(x2, weight, bias, y, activation)
        m, n = y.shape
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        _linear_glu_kernel[grid](*args, **constexprs)
    return out if out is not None else y.view(*x.shape[:-1], weight.shape[0] // 2)
