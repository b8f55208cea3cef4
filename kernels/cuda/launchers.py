"""Python launchers of the CUDA backend: the same signatures as the Triton launchers and the reference
(out= included), shaping inputs to [rows, cols] and calling torch.ops.fusedserve_cuda.* with a tuned launch
configuration. Importing this module needs the built extension (kernels.cuda.build.load())."""

from __future__ import annotations

import torch
from torch import Tensor

from fusedserve.kernels._layout import (as_rows, as_vector, common_device, embedding_inputs, output_like, same_shape,
                             segment_arguments)
from fusedserve.kernels.cuda.tuning import TUNER, norm_candidates, pointwise_candidates

_ops = torch.ops.fusedserve_cuda
_GELU = {"none": 1, "tanh": 2}
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _gelu_code(approximate: str) -> int:
    try:
        return _GELU[approximate]
    except KeyError:
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}") from None


def _check(name: str, *tensors: Tensor | None) -> None:
    device = common_device(name, tensors, _DTYPES)
    if device.type != "cuda":
        raise ValueError(f"{name}: tensors must be on one CUDA device, got {device}")


def _norm(name: str, x: Tensor, residual: Tensor | None, bias: Tensor | None, weight: Tensor, ln_bias: Tensor,
          eps: float, gelu: int, out: Tensor | None, return_sum: bool = False):
    _check(name, x, residual, bias, weight, ln_bias)
    cols = x.shape[-1]
    x2 = as_rows(x, cols, name)
    r2 = None if residual is None else as_rows(residual, cols, f"{name} residual")
    b = None if bias is None else as_vector(bias, cols, f"{name} bias")
    w, lb = as_vector(weight, cols, f"{name} weight"), as_vector(ln_bias, cols, f"{name} ln_bias")
    y = output_like(x2, x.shape, out, name)
    s = torch.empty_like(x2) if return_sum else None

    def run(config):
        _ops.norm(x2, r2, b, w, lb, eps, gelu, y, s, *config)

    run(TUNER.choose("norm", x2.dtype, cols, x2.shape[0], norm_candidates(cols), run))
    y = out if out is not None else y.view(x.shape)
    return (y, s.view(x.shape)) if return_sum else y


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-12, *, out: Tensor | None = None) -> Tensor:
    return _norm("layer_norm", x, None, None, weight, bias, eps, 0, out)


def layer_norm_gelu(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-12, approximate: str = "none", *,
                    out: Tensor | None = None) -> Tensor:
    return _norm("layer_norm_gelu", x, None, None, weight, bias, eps, _gelu_code(approximate), out)


def add_layer_norm(x: Tensor, residual: Tensor, bias: Tensor | None, weight: Tensor, ln_bias: Tensor,
                   eps: float = 1e-12, *, return_sum: bool = False,
                   out: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    same_shape("add_layer_norm", x, residual, "residual")
    return _norm("add_layer_norm", x, residual, bias, weight, ln_bias, eps, 0, out, return_sum)


def _bias_act(name: str, x: Tensor, bias: Tensor, residual: Tensor | None, gelu: int, out: Tensor | None) -> Tensor:
    _check(name, x, bias, residual)
    cols = x.shape[-1]
    x2 = as_rows(x, cols, name, max_cols=2**31)
    r2 = None if residual is None else as_rows(residual, cols, f"{name} residual", max_cols=2**31)
    b = as_vector(bias, cols, f"{name} bias")
    y = output_like(x2, x.shape, out, name)

    def run(config):
        _ops.bias_act(x2, b, r2, gelu, y, *config)

    run(TUNER.choose("pointwise", x2.dtype, cols, x2.shape[0], pointwise_candidates(cols, x2.shape[0]), run))
    return out if out is not None else y.view(x.shape)


def bias_gelu(x: Tensor, bias: Tensor, approximate: str = "none", *, out: Tensor | None = None) -> Tensor:
    return _bias_act("bias_gelu", x, bias, None, _gelu_code(approximate), out)


def bias_residual_gelu(x: Tensor, bias: Tensor, residual: Tensor, approximate: str = "none", *,
                       out: Tensor | None = None) -> Tensor:
    same_shape("bias_residual_gelu", x, residual, "residual")
    return _bias_act("bias_residual_gelu", x, bias, residual, _gelu_code(approximate), out)


def embedding_layer_norm(input_ids: Tensor, position_ids: Tensor, token_type_ids: Tensor, word_embeddings: Tensor,
                         position_embeddings: Tensor, token_type_embeddings: Tensor, weight: Tensor, bias: Tensor,
                         eps: float = 1e-12, *, out: Tensor | None = None) -> Tensor:
    name = "embedding_layer_norm"
    _check(name, word_embeddings, position_embeddings, token_type_embeddings, weight, bias)
    ids, pos, types, word, position, token_type, y, shape = embedding_inputs(
        input_ids, position_ids, token_type_ids, word_embeddings, position_embeddings, token_type_embeddings, out,
        id_dtype=torch.int64)
    rows, cols = y.shape
    w, b = as_vector(weight, cols, f"{name} weight"), as_vector(bias, cols, f"{name} bias")

    def run(config):
        _ops.embedding_norm(ids, pos, types, word, position, token_type, w, b, eps, y, *config)

    run(TUNER.choose("embedding_norm", y.dtype, cols, rows, norm_candidates(cols), run))
    return out if out is not None else y.view(shape)


def linear_bias_gelu(x: Tensor, weight: Tensor, bias: Tensor, approximate: str = "none", *,
                     out: Tensor | None = None) -> Tensor:
    """The FFN-in as this backend runs it: the GEMM on cuBLAS (F.linear, no bias), then the CUDA bias + GELU
    kernel over its output. (cuBLASLt's own GELU epilogue is the tanh approximation; Triton has the fused GEMM.)"""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"linear_bias_gelu: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit")
    return bias_gelu(torch.nn.functional.linear(x, weight), bias, approximate, out=out)


def linear_add_layer_norm(x: Tensor, weight: Tensor, bias: Tensor, residual: Tensor, ln_weight: Tensor,
                          ln_bias: Tensor, eps: float = 1e-12, *, out: Tensor | None = None) -> Tensor:
    """The attention-out / FFN-out block as this backend runs it: the GEMM on cuBLAS (F.linear, no bias), then the
    CUDA add + LayerNorm kernel (bias and residual added there), as the Triton backend does with its own."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"linear_add_layer_norm: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit")
    return add_layer_norm(torch.nn.functional.linear(x, weight), residual, bias, ln_weight, ln_bias, eps, out=out)


def segment_mean(x: Tensor, cu_seqlens: Tensor, *, out: Tensor | None = None) -> Tensor:
    """Mean of each segment of x's rows (the packed batch's mean pooling) -> [segments, hidden] float32."""
    _check("segment_mean", x)
    x2, cu, y = segment_arguments("segment_mean", x, cu_seqlens, out, torch.float32)
    _ops.segment_mean(x2, cu, y)
    return y
