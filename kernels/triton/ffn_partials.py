"""A layer's feed-forward block for a few tokens, split over the intermediate width: one kernel computes
GELU(x W1^T + b1) and its product with W2, as partial sums that partial_add_layer_norm adds up with the bias and the
residual before the LayerNorm.

Why: at a single short request (MiniLM b1 s16) the FFN is three kernels (the GEMM + GELU, cuBLAS for the second
GEMM, the add + LayerNorm), each a few microseconds of latency, and the [16, 1536] intermediate makes a round
trip through memory. Split over the intermediate columns, each program owns a chunk j of them: h_j = GELU(x W1_j^T +
b1_j) stays in registers and goes straight into h_j W2[:, j]^T, a [rows, H] partial product. The programs never
meet (no counters, no atomics: what made the split GEMM + LayerNorm lose, docs/decisions/0001-split-gemm-layer-norm.md); the
chunks' partial sums land in a [splits, T, H] fp32 workspace that the LayerNorm kernel reads in a fixed order, so
the result is deterministic. Both weights are read once per row block, spread over `splits` SMs. This is for a few
rows: each row block re-reads both weights, and the workspace grows with splits x T x H.

h_j is rounded to the input dtype before the second product, as the unfused path stores the intermediate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusedserve.kernels import reference
from fusedserve.kernels.triton._common import INTERPRET, check_device, deferrable, pdl_args, pdl_sync
from fusedserve.kernels.triton._gelu import GELU_MODES, gelu
from fusedserve.kernels.triton.qkv_attention import _dot, _operand, _project

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_CHUNK = 128  # intermediate columns one program holds ([rows, chunk] fp32 in registers); wider chunks: torch


@deferrable
@triton.jit(do_not_specialize=["T"])  # counts: see _common.autotune
def _ffn_partials_kernel(x_ptr, w1_ptr, b1_ptr, w2_ptr, p_ptr, T, H, CHUNK, stride_x, stride_w1, stride_w2,
                         MODE: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
                         BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr = False):
    chunk = tl.program_id(1)
    pdl_sync(USE_PDL)
    first = tl.program_id(0) * BLOCK_M
    rows = first + tl.arange(0, BLOCK_M)
    inner = tl.arange(0, BLOCK_I)
    in_chunk = inner < CHUNK
    icols = chunk * CHUNK + inner
    # x[rows] @ W1_j^T + b1_j: the attention kernel's projection with the chunk's CHUNK rows of W1 as the "head"
    acc = _project(x_ptr, w1_ptr + (chunk * CHUNK).to(tl.int64) * stride_w1, b1_ptr + chunk * CHUNK, first, T, H,
                   CHUNK, stride_x, stride_w1, BLOCK_M, BLOCK_I, BLOCK_K, IEEE)
    # rounded as the unfused path stores the intermediate (columns past the chunk: GELU(0) = 0)
    h = _operand(gelu(acc, MODE), x_ptr.dtype.element_ty, IEEE)
    p_ptrs = p_ptr + chunk.to(tl.int64) * T * H + rows[:, None].to(tl.int64) * H
    for n0 in range(0, H, BLOCK_N):
        ns = n0 + tl.arange(0, BLOCK_N)
        w2 = tl.load(w2_ptr + ns[None, :].to(tl.int64) * stride_w2 + icols[:, None],
                     mask=in_chunk[:, None] & (ns[None, :] < H), other=0.0)  # W2[:, j]^T tile [BLOCK_I, BLOCK_N]
        prod = _dot(h, w2, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), IEEE)
        tl.store(p_ptrs + ns[None, :], prod, mask=(rows[:, None] < T) & (ns[None, :] < H))


def ffn_partials(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, splits: int, approximate: str = "none", *,
                 out: Tensor | None = None) -> Tensor:
    """GELU(x @ w1^T + b1) @ w2^T as `splits` partial sums over equal chunks of the intermediate width: x [T, H],
    w1 [I, H], b1 [I], w2 [H, I] (nn.Linear's layouts), I divisible by splits -> [splits, T, H] fp32; `out`
    (contiguous, that shape, fp32) is written in place."""
    name = "ffn_partials"
    check_device(name, x, w1, b1, w2)
    if x.dtype not in DTYPES or not (w1.dtype == b1.dtype == w2.dtype == x.dtype):
        raise TypeError(f"{name}: x, w1, b1 and w2 must share one of {DTYPES}, got "
                        f"{x.dtype}, {w1.dtype}, {b1.dtype}, {w2.dtype}")
    if approximate not in GELU_MODES:
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    if x.dim() != 2 or w1.dim() != 2 or w1.shape[1] != x.shape[1] or b1.shape != (w1.shape[0],) or \
            w2.shape != (x.shape[1], w1.shape[0]):
        raise ValueError(f"{name}: x {tuple(x.shape)}, w1 {tuple(w1.shape)}, b1 {tuple(b1.shape)} and w2 "
                         f"{tuple(w2.shape)} do not fit GELU(x w1^T + b1) w2^T")
    (t, hidden), inner = x.shape, w1.shape[0]
    if splits < 1 or inner % splits:
        raise ValueError(f"{name}: {splits} splits do not divide the intermediate width {inner}")
    shape = (splits, t, hidden)
    if out is not None and (out.shape != shape or out.dtype != torch.float32 or not out.is_contiguous()):
        raise ValueError(f"{name}: out must be a contiguous float32 tensor of shape {shape}")
    if inner // splits > MAX_CHUNK:
        return reference.ffn_partials(x, w1, b1, w2, splits, approximate, out=out)
    y = out if out is not None else torch.empty(shape, dtype=torch.float32, device=x.device)
    if y.numel():
        x, w1, b1, w2 = x.contiguous(), w1.contiguous(), b1.contiguous(), w2.contiguous()
        chunk = inner // splits
        # larger steps under the interpreter, whose cost is per operation (the masks make any step exact)
        block_m = min(max(triton.next_power_of_2(t), 16), 128 if INTERPRET else 64)
        step = min(max(triton.next_power_of_2(hidden), 16), 512 if INTERPRET else 64)
        _ffn_partials_kernel[(triton.cdiv(t, block_m), splits)](
            x, w1, b1, w2, y, t, hidden, chunk, x.stride(0), w1.stride(0), w2.stride(0),
            MODE=GELU_MODES[approximate], IEEE=x.dtype == torch.float32 or (INTERPRET and x.dtype == torch.bfloat16),
            BLOCK_M=block_m, BLOCK_I=max(triton.next_power_of_2(chunk), 16),
            BLOCK_K=step, BLOCK_N=step, num_warps=4, **pdl_args(x))
    return y

