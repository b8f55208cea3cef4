"""FP8 (E4M3) GEMMs for the opt-in fp8 precision (PRECISION=fp8) on GPUs with FP8 tensor cores.

A layer's four GEMMs take E4M3 operands with fp32 scales and give fp16/bf16 out (torch._scaled_mm): weights are
quantized once, per output channel; activations per row (token), by the op that produces them: the LayerNorm after a
residual add, bias + GELU, or a pass of its own for the attention's context. Per-row scales computed where the row is
already in registers cost nothing to find and follow each batch's own range, so no activation scale is calibrated
ahead or kept (docs/decisions/0025-fp8-activations.md).

These are not registry ops (kernels.spec): they run only where FP8 GEMMs do (CUDA, compute capability 8.9+), where
Triton is their one backend, so there is no per-op choice to make. self_test() checks each against its torch
reference here (the ground truth of the tests as well) when the precision is turned on; the model refuses the
precision, naming the op, when one fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

E4M3_MAX = 448.0
MIN_AMAX = 1e-12  # a row of zeros (or an all-zero weight channel) gets this amax: its values stay 0
# the compute capability from which GPUs have FP8 tensor cores (Ada 8.9, Hopper 9.0 and later)
FP8_CAPABILITY = (8, 9)


class Fp8Unavailable(RuntimeError):
    """FP8 cannot run here: the device, the torch build, a shape or a kernel's self-test; the message says which."""


def unavailable(device: torch.device) -> str | None:
    """Why FP8 GEMMs cannot run on `device`, or None when they can."""
    if device.type != "cuda":
        return f"device {device} has no FP8 tensor cores (PRECISION=fp8 needs an NVIDIA GPU of compute capability " \
               f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or later: Ada, Hopper, Blackwell)"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        return f"{torch.cuda.get_device_name(device)} (compute capability {capability[0]}.{capability[1]}) has no " \
               f"FP8 tensor cores (PRECISION=fp8 needs {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or later)"
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    return None


@dataclass(frozen=True)
class QuantizedWeight:
    """An nn.Linear weight [out, in] in E4M3 with one fp32 scale per output channel ([1, out], as _scaled_mm's
    scale_b takes it)."""

    values: Tensor  # [out, in] float8_e4m3fn, row-major: its transpose is the column-major operand _scaled_mm wants
    scale: Tensor   # [1, out] float32

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scale.nbytes


def _round(v: Tensor) -> Tensor:
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_weight(weight: Tensor) -> QuantizedWeight:
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(MIN_AMAX) / E4M3_MAX
    k = w.shape[1]
    if k % 16 or w.shape[0] % 16:
        raise Fp8Unavailable(f"a GEMM of shape [{w.shape[0]}, {k}] cannot run in FP8 (both sides must be multiples "
                             "of 16)")
    return QuantizedWeight(_round(w / scale[:, None]).contiguous(), scale[None, :].contiguous())


# ---- the torch references (any device) --------------------------------------------------------------------------

def quantize_rows_reference(x: Tensor) -> tuple[Tensor, Tensor]:
    """Each row of x [rows, cols] in E4M3 with its scale amax / 448: (values [rows, cols], scales [rows, 1] fp32)."""
    v = x.float()
    scale = v.abs().amax(dim=1, keepdim=True).clamp_min(MIN_AMAX) / E4M3_MAX
    return _round(v / scale), scale


def bias_gelu_quantize_reference(x: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """quantize_rows(GELU(x + bias)), exact GELU computed in fp32."""
    return quantize_rows_reference(F.gelu(x.float() + bias.float()))


def add_layer_norm_quantize_reference(x: Tensor, residual: Tensor, bias: Tensor, weight: Tensor, ln_bias: Tensor,
                                      eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """y = LayerNorm(x + residual + bias) in residual's dtype, and quantize_rows(y)."""
    v = x.float() + residual.float() + bias.float()
    y = F.layer_norm(v, v.shape[-1:], weight.float(), ln_bias.float(), eps).to(residual.dtype)
    return (y, *quantize_rows_reference(y))


# ---- the ops a layer calls --------------------------------------------------------------------------------------

def _triton(x: Tensor) -> bool:
    return x.device.type == "cuda"


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    if _triton(x):
        from fusedserve.kernels.triton import fp8

        return fp8.quantize_rows(x)
    return quantize_rows_reference(x)


def bias_gelu_quantize(x: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    if _triton(x):
        from fusedserve.kernels.triton import fp8

        return fp8.bias_gelu_quantize(x, bias)
    return bias_gelu_quantize_reference(x, bias)


def add_layer_norm_quantize(x: Tensor, residual: Tensor, bias: Tensor, weight: Tensor, ln_bias: Tensor,
                            eps: float) -> tuple[Tensor, Tensor, Tensor]:
    if _triton(x):
        from fusedserve.kernels.triton import fp8

        return fp8.add_layer_norm_quantize(x, residual, bias, weight, ln_bias, eps)
    return add_layer_norm_quantize_reference(x, residual, bias, weight, ln_bias, eps)


def linear(xq: Tensor, x_scale: Tensor, weight: QuantizedWeight, bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    """x W^T (+ bias) from row-quantized x [rows, in] and a quantized weight, fp32 accumulation, out in out_dtype."""
    return torch._scaled_mm(xq, weight.values.t(), scale_a=x_scale, scale_b=weight.scale, bias=bias,
                            out_dtype=out_dtype)


# ---- the self-test ----------------------------------------------------------------------------------------------

def dequantize(q: Tensor, scale: Tensor) -> Tensor:
    return q.double() * scale.double()


def quantization_error(q: Tensor, scale: Tensor, v: Tensor) -> float:
    """The largest error of the dequantized rows against v (float64), in units of the bound rounding to E4M3
    allows: half a step, 2^-4 of the value in its binade, or 2^-10 of the row's scale among the subnormals. At most
    1.0 for a correct quantization (a little over where the kernel's fp32 value of x / scale sits within an ulp of
    a tie)."""
    v = v.double()
    bound = v.abs() / 16 + scale.double() * 2.0 ** -10
    return float(((dequantize(q, scale) - v).abs() / bound).max())


def self_test(device: torch.device, dtype: torch.dtype, cols: tuple[int, ...]) -> None:
    """Each quantizing op on fresh random rows of every width in `cols` against the float64 value it quantizes;
    raises Fp8Unavailable naming the op that fails (or cannot run)."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0, shift=0.0):
        return (torch.randn(shape, generator=gen) * scale + shift).to(device, dtype)

    for n in sorted(set(cols)):
        x, r, bias = randn(67, n, scale=2.0, shift=0.5), randn(67, n), randn(n, scale=0.5)
        w, b = randn(n, scale=0.5, shift=1.0), randn(n, scale=0.5)
        checks = {}
        try:
            checks["quantize_rows"] = (quantize_rows(x), x)
            checks["bias_gelu_quantize"] = (bias_gelu_quantize(x, bias), F.gelu(x.double() + bias.double()))
            y, q, s = add_layer_norm_quantize(x, r, bias, w, b, 1e-12)
            want = F.layer_norm(x.double() + r.double() + bias.double(), (n,), w.double(), b.double(), 1e-12)
            if (y.double() - want).abs().max() > 0.05:
                raise Fp8Unavailable(f"FP8 op add_layer_norm_quantize failed its self-test at {n} columns: its "
                                     "LayerNorm output is off")
            checks["add_layer_norm_quantize"] = ((q, s), y)
        except Fp8Unavailable:
            raise
        except Exception as exc:
            raise Fp8Unavailable(f"FP8 op {OPS[len(checks)]} cannot run at {n} columns: "
                                 f"{type(exc).__name__}: {exc}") from exc
        for op, ((q, s), v) in checks.items():
            err = quantization_error(q, s, v)
            if not err <= 1.01:  # NaN fails too
                raise Fp8Unavailable(f"FP8 op {op} failed its self-test at {n} columns: error {err:.3g} x the "
                                     "rounding bound")


OPS = ("quantize_rows", "bias_gelu_quantize", "add_layer_norm_quantize")
