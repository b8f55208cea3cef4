"""Fused transformer ops with interchangeable backends (Triton, CUDA, torch reference).

Call the ops below; `kernels.registry.configure()` decides, per op, which backend runs them.
Until it is called every op runs on the torch reference.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading

import torch
from torch import Tensor

from kernels import registry
from kernels.registry import BackendError, BackendUnavailable, Selection, configure

__all__ = [
    "BackendError", "Selection", "configure", "registry", "reference_path",
    "layer_norm", "layer_norm_gelu", "bias_gelu", "bias_residual_gelu", "add_layer_norm", "embedding_layer_norm",
    "linear_bias_gelu", "linear_add_layer_norm", "segment_mean", "qkv_attention", "attention_partials",
    "ffn_partials", "partial_add_layer_norm",
]

_active = registry.active
_local = threading.local()


def _ops():
    """The op table for this thread: the registry's choice, or the reference inside reference_path()."""
    return getattr(_local, "ops", None) or _active


def on_reference_path() -> bool:
    """True inside reference_path() in this thread."""
    return getattr(_local, "ops", None) is not None


@contextlib.contextmanager
def reference_path():
    """Run every op on the torch reference in this thread only (the server's background verifier uses
    this while the serving thread keeps the fused path)."""
    from kernels import reference

    previous = getattr(_local, "ops", None)
    _local.ops = reference.OPS
    try:
        yield
    finally:
        _local.ops = previous


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-12) -> Tensor:
    """LayerNorm over the last dimension."""
    return _ops()["layer_norm"](x, weight, bias, eps)


def layer_norm_gelu(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-12, approximate: str = "none") -> Tensor:
    """GELU(LayerNorm(x)); exact erf GELU unless approximate="tanh"."""
    return _ops()["layer_norm_gelu"](x, weight, bias, eps, approximate)


def bias_gelu(x: Tensor, bias: Tensor, approximate: str = "none") -> Tensor:
    """GELU(x + bias), bias broadcast over rows."""
    return _ops()["bias_gelu"](x, bias, approximate)


def linear_bias_gelu(x: Tensor, weight: Tensor, bias: Tensor, approximate: str = "none") -> Tensor:
    """GELU(x @ weight^T + bias), weight in nn.Linear's [out, in] layout: the FFN-in of an encoder layer."""
    return _ops()["linear_bias_gelu"](x, weight, bias, approximate)


def linear_add_layer_norm(x: Tensor, weight: Tensor, bias: Tensor, residual: Tensor, ln_weight: Tensor,
                          ln_bias: Tensor, eps: float = 1e-12) -> Tensor:
    """LayerNorm(x @ weight^T + bias + residual), weight in nn.Linear's [out, in] layout: the attention-out and
    FFN-out blocks of a post-LN encoder layer."""
    return _ops()["linear_add_layer_norm"](x, weight, bias, residual, ln_weight, ln_bias, eps)


def bias_residual_gelu(x: Tensor, bias: Tensor, residual: Tensor, approximate: str = "none") -> Tensor:
    """GELU(x + bias + residual)."""
    return _ops()["bias_residual_gelu"](x, bias, residual, approximate)


def add_layer_norm(
    x: Tensor,
    residual: Tensor,
    bias: Tensor | None,
    weight: Tensor,
    ln_bias: Tensor,
    eps: float = 1e-12,
    *,
    return_sum: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """LayerNorm(x + bias + residual); with return_sum=True also the pre-norm sum."""
    return _ops()["add_layer_norm"](x, residual, bias, weight, ln_bias, eps, return_sum=return_sum)


def embedding_layer_norm(
    input_ids: Tensor,
    position_ids: Tensor,
    token_type_ids: Tensor,
    word_embeddings: Tensor,
    position_embeddings: Tensor,
    token_type_embeddings: Tensor,
    weight: Tensor,
    bias: Tensor,
    eps: float = 1e-12,
) -> Tensor:
    """LayerNorm(word[ids] + position[pos] + token_type[types]) for flat id vectors: [tokens] -> [tokens, hidden]."""
    return _ops()["embedding_layer_norm"](
        input_ids, position_ids, token_type_ids, word_embeddings, position_embeddings, token_type_embeddings,
        weight, bias, eps,
    )


def segment_mean(x: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Mean of each segment of rows, x [T, H] and offsets cu_seqlens [B + 1] -> [B, H] float32 (empty segment: 0;
    rows past the last offset unread): the mean pooling of a packed batch."""
    return _ops()["segment_mean"](x, cu_seqlens)


def qkv_attention(x: Tensor, weight: Tensor, bias: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                  num_heads: int) -> Tensor:
    """A layer's attention block before its output projection: q, k, v = x @ weight^T + bias (weight [3H, H], nn.Linear's
    layout, query/key/value stacked), softmax(q k^T / sqrt(d)) v per head within each packed sequence of x [T, H]
    (offsets cu_seqlens [B + 1], each at most max_seqlen long) -> [T, H]; rows past the last offset are zeros."""
    return _ops()["qkv_attention"](x, weight, bias, cu_seqlens, max_seqlen, num_heads)


def attention_partials(x: Tensor, weight: Tensor, bias: Tensor, cu_seqlens: Tensor, max_seqlen: int, num_heads: int,
                       out_weight: Tensor) -> Tensor:
    """qkv_attention's context times each head's slice of the output projection out_weight [H, H]: [num_heads, T, H]
    float32 partial sums (summed: ctx @ out_weight^T), for partial_add_layer_norm."""
    return _ops()["attention_partials"](x, weight, bias, cu_seqlens, max_seqlen, num_heads, out_weight)


def ffn_partials(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, splits: int, approximate: str = "none") -> Tensor:
    """GELU(x @ w1^T + b1) @ w2^T as `splits` float32 partial sums over chunks of the intermediate width: [splits,
    T, H], for partial_add_layer_norm."""
    return _ops()["ffn_partials"](x, w1, b1, w2, splits, approximate)


def partial_add_layer_norm(parts: Tensor, bias: Tensor | None, residual: Tensor, weight: Tensor, ln_bias: Tensor,
                           eps: float = 1e-12) -> Tensor:
    """LayerNorm(parts.sum(0) + bias + residual): parts [P, T, H] float32 -> [T, H] in residual's dtype."""
    return _ops()["partial_add_layer_norm"](parts, bias, residual, weight, ln_bias, eps)


def _load_triton(device: torch.device):
    if importlib.util.find_spec("triton") is None:
        raise BackendUnavailable("the triton package is not installed")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise BackendUnavailable(f"needs a CUDA device, got {device} (TRITON_INTERPRET=1 runs it on the CPU, for tests)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailable("CUDA is not available")
    from kernels import ops
    from kernels.triton import LAUNCHERS

    return ops.custom_ops("triton", LAUNCHERS)


registry.register_backend("triton", _load_triton)


def _load_cuda(device: torch.device):
    if device.type != "cuda":
        raise BackendUnavailable(f"needs a CUDA device, got {device}")
    if not torch.cuda.is_available():
        raise BackendUnavailable("CUDA is not available")
    from kernels import cuda, ops

    try:
        launchers = cuda.load()
    except cuda.BuildUnavailable as exc:
        raise BackendUnavailable(str(exc)) from exc
    return ops.custom_ops("cuda", launchers)


registry.register_backend("cuda", _load_cuda)
