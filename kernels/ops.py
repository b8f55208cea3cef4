"""torch.library custom-op registration for the fused backends, so `torch.compile` sees each fused op as
one opaque node (no graph breaks, no tracing into Triton launchers), with fake (meta) implementations for
shape propagation and autograd for layer_norm_gelu and add_layer_norm.

Eager calls skip the custom-op dispatcher (tens of microseconds per call) and go straight to the launcher,
unless torch.compile is tracing or autograd needs the graph. Backward passes recompute through the fp32
torch reference: they are for fine-tuning and tests, not the serving hot path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from kernels import reference

_cache: dict[str, dict[str, Callable]] = {}


def _eager(*tensors: Tensor | None) -> bool:
    """True when the launcher can be called directly: not tracing, and no input wants a gradient."""
    if torch.compiler.is_compiling():
        return False
    if torch.is_grad_enabled():
        return not any(t is not None and t.requires_grad for t in tensors)
    return True


def _recompute_grads(fn: Callable, inputs: list[Tensor | None], outputs_grads: Callable) -> list[Tensor | None]:
    """Gradients of the reference `fn` at `inputs` (recomputed in fp32 under autograd)."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) if t is not None else None for t in inputs]
        outs, grads = outputs_grads(fn(*leaves))
        wanted = [t for t in leaves if t is not None]
        got = iter(torch.autograd.grad(outs, wanted, grads, allow_unused=True))
        return [next(got) if t is not None else None for t in leaves]


def _define(backend: str, launchers: Mapping[str, Callable]) -> dict[str, Callable]:
    lib = f"fusedserve::{backend}_"
    ops: dict[str, Callable] = {}

    # ---- layer_norm ------------------------------------------------------------------------------
    @torch.library.custom_op(lib + "layer_norm", mutates_args=())
    def layer_norm_op(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
        return launchers["layer_norm"](x, weight, bias, eps)

    layer_norm_op.register_fake(lambda x, weight, bias, eps: torch.empty_like(x))

    def layer_norm(x, weight, bias, eps=1e-12, *, out=None):
        if out is not None or _eager(x, weight, bias):
            return launchers["layer_norm"](x, weight, bias, eps, out=out)
        return layer_norm_op(x, weight, bias, eps)

    ops["layer_norm"] = layer_norm

    # ---- layer_norm_gelu (with autograd) ---------------------------------------------------------
    @torch.library.custom_op(lib + "layer_norm_gelu", mutates_args=())
    def layer_norm_gelu_op(x: Tensor, weight: Tensor, bias: Tensor, eps: float, approximate: str) -> Tensor:
        return launchers["layer_norm_gelu"](x, weight, bias, eps, approximate)

    layer_norm_gelu_op.register_fake(lambda x, weight, bias, eps, approximate: torch.empty_like(x))

    def ln_gelu_setup(ctx, inputs, output):
        x, weight, bias, ctx.eps, ctx.approximate = inputs
        ctx.save_for_backward(x, weight, bias)

    def ln_gelu_backward(ctx, grad_y):
        grads = _recompute_grads(
            lambda x, w, b: reference.layer_norm_gelu(x, w, b, ctx.eps, ctx.approximate),
            list(ctx.saved_tensors), lambda y: ([y], [grad_y]))
        return (*grads, None, None)

    layer_norm_gelu_op.register_autograd(ln_gelu_backward, setup_context=ln_gelu_setup)

    def layer_norm_gelu(x, weight, bias, eps=1e-12, approximate="none", *, out=None):
        if out is not None or _eager(x, weight, bias):
            return launchers["layer_norm_gelu"](x, weight, bias, eps, approximate, out=out)
        return layer_norm_gelu_op(x, weight, bias, eps, approximate)

    ops["layer_norm_gelu"] = layer_norm_gelu

    # ---- bias_gelu, bias_residual_gelu ----------------------------------------------------------
    @torch.library.custom_op(lib + "bias_gelu", mutates_args=())
    def bias_gelu_op(x: Tensor, bias: Tensor, approximate: str) -> Tensor:
        return launchers["bias_gelu"](x, bias, approximate)

    bias_gelu_op.register_fake(lambda x, bias, approximate: torch.empty_like(x))

    def bias_gelu(x, bias, approximate="none", *, out=None):
        if out is not None or _eager(x, bias):
            return launchers["bias_gelu"](x, bias, approximate, out=out)
        return bias_gelu_op(x, bias, approximate)

    ops["bias_gelu"] = bias_gelu

    @torch.library.custom_op(lib + "bias_residual_gelu", mutates_args=())
    def bias_residual_gelu_op(x: Tensor, bias: Tensor, residual: Tensor, approximate: str) -> Tensor:
        return launchers["bias_residual_gelu"](x, bias, residual, approximate)

    bias_residual_gelu_op.register_fake(lambda x, bias, residual, approximate: torch.empty_like(x))

    def bias_residual_gelu(x, bias, residual, approximate="none", *, out=None):
        if out is not None or _eager(x, bias, residual):
            return launchers["bias_residual_gelu"](x, bias, residual, approximate, out=out)
        return bias_residual_gelu_op(x, bias, residual, approximate)

    ops["bias_residual_gelu"] = bias_residual_gelu

    # ---- add_layer_norm (with autograd; the pre-norm sum is an empty tensor unless asked for) -------
    @torch.library.custom_op(lib + "add_layer_norm", mutates_args=())
    def add_layer_norm_op(x: Tensor, residual: Tensor, bias: Tensor | None, weight: Tensor, ln_bias: Tensor,
                          eps: float, return_sum: bool) -> tuple[Tensor, Tensor]:
        if return_sum:
            return launchers["add_layer_norm"](x, residual, bias, weight, ln_bias, eps, return_sum=True)
        return launchers["add_layer_norm"](x, residual, bias, weight, ln_bias, eps), x.new_empty(0)

    @add_layer_norm_op.register_fake
    def _(x, residual, bias, weight, ln_bias, eps, return_sum):
        return torch.empty_like(x), (torch.empty_like(x) if return_sum else x.new_empty(0))

    def add_ln_setup(ctx, inputs, output):
        x, residual, bias, weight, ln_bias, ctx.eps, ctx.return_sum = inputs
        ctx.save_for_backward(x, residual, bias, weight, ln_bias)

    def add_ln_backward(ctx, grad_y, grad_sum):
        def pick(outputs):
            y, s = outputs
            if ctx.return_sum and grad_sum is not None and grad_sum.numel():
                return [y, s], [grad_y, grad_sum]
            return [y], [grad_y]

        grads = _recompute_grads(
            lambda x, r, bias, w, b: reference.add_layer_norm(x, r, bias, w, b, ctx.eps, return_sum=True),
            list(ctx.saved_tensors), pick)
        return (*grads, None, None)

    add_layer_norm_op.register_autograd(add_ln_backward, setup_context=add_ln_setup)

    def add_layer_norm(x, residual, bias, weight, ln_bias, eps=1e-12, *, return_sum=False, out=None):
        if out is not None or _eager(x, residual, bias, weight, ln_bias):
            return launchers["add_layer_norm"](x, residual, bias, weight, ln_bias, eps, return_sum=return_sum, out=out)
        y, s = add_layer_norm_op(x, residual, bias, weight, ln_bias, eps, return_sum)
        return (y, s) if return_sum else y

    ops["add_layer_norm"] = add_layer_norm

    # ---- linear_bias_gelu ------------------------------------------------------------------------
    @torch.library.custom_op(lib + "linear_bias_gelu", mutates_args=())
    def linear_bias_gelu_op(x: Tensor, weight: Tensor, bias: Tensor, approximate: str) -> Tensor:
        return launchers["linear_bias_gelu"](x, weight, bias, approximate)

    linear_bias_gelu_op.register_fake(
        lambda x, weight, bias, approximate: x.new_empty((*x.shape[:-1], weight.shape[0])))

    def linear_bias_gelu(x, weight, bias, approximate="none", *, out=None):
        if out is not None or _eager(x, weight, bias):
            return launchers["linear_bias_gelu"](x, weight, bias, approximate, out=out)
        return linear_bias_gelu_op(x, weight, bias, approximate)

    ops["linear_bias_gelu"] = linear_bias_gelu

    # ---- linear_add_layer_norm -------------------------------------------------------------------
    @torch.library.custom_op(lib + "linear_add_layer_norm", mutates_args=())
    def linear_add_layer_norm_op(x: Tensor, weight: Tensor, bias: Tensor, residual: Tensor, ln_weight: Tensor,
                                 ln_bias: Tensor, eps: float) -> Tensor:
        return launchers["linear_add_layer_norm"](x, weight, bias, residual, ln_weight, ln_bias, eps)

    linear_add_layer_norm_op.register_fake(
        lambda x, weight, bias, residual, ln_weight, ln_bias, eps: x.new_empty((*x.shape[:-1], weight.shape[0])))

    def linear_add_layer_norm(x, weight, bias, residual, ln_weight, ln_bias, eps=1e-12, *, out=None):
        if out is not None or _eager(x, weight, bias, residual, ln_weight, ln_bias):
            return launchers["linear_add_layer_norm"](x, weight, bias, residual, ln_weight, ln_bias, eps, out=out)
        return linear_add_layer_norm_op(x, weight, bias, residual, ln_weight, ln_bias, eps)

    ops["linear_add_layer_norm"] = linear_add_layer_norm

    # ---- embedding_layer_norm --------------------------------------------------------------------
    @torch.library.custom_op(lib + "embedding_layer_norm", mutates_args=())
    def embedding_layer_norm_op(input_ids: Tensor, position_ids: Tensor, token_type_ids: Tensor,
                                word_embeddings: Tensor, position_embeddings: Tensor, token_type_embeddings: Tensor,
                                weight: Tensor, bias: Tensor, eps: float) -> Tensor:
        return launchers["embedding_layer_norm"](input_ids, position_ids, token_type_ids, word_embeddings,
                                                 position_embeddings, token_type_embeddings, weight, bias, eps)

    @embedding_layer_norm_op.register_fake
    def _(input_ids, position_ids, token_type_ids, word_embeddings, *rest):
        return word_embeddings.new_empty((*input_ids.shape, word_embeddings.shape[1]))

    def embedding_layer_norm(input_ids, position_ids, token_type_ids, word_embeddings, position_embeddings,
                             token_type_embeddings, weight, bias, eps=1e-12, *, out=None):
        args = (input_ids, position_ids, token_type_ids, word_embeddings, position_embeddings,
                token_type_embeddings, weight, bias, eps)
        if out is not None or _eager(word_embeddings, position_embeddings, token_type_embeddings, weight, bias):
            return launchers["embedding_layer_norm"](*args, out=out)
        return embedding_layer_norm_op(*args)

    ops["embedding_layer_norm"] = embedding_layer_norm

    # ---- segment_mean ----------------------------------------------------------------------------
    @torch.library.custom_op(lib + "segment_mean", mutates_args=())
    def segment_mean_op(x: Tensor, cu_seqlens: Tensor) -> Tensor:
        return launchers["segment_mean"](x, cu_seqlens)

    segment_mean_op.register_fake(lambda x, cu_seqlens: x.new_empty(
        (cu_seqlens.shape[0] - 1, x.shape[1]), dtype=torch.float64 if x.dtype == torch.float64 else torch.float32))

    def segment_mean(x, cu_seqlens, *, out=None):
        if out is not None or _eager(x):
            return launchers["segment_mean"](x, cu_seqlens, out=out)
        return segment_mean_op(x, cu_seqlens)

    ops["segment_mean"] = segment_mean

    # ---- Triton-only ops (a backend may leave them out: the registry then keeps the reference) ------------
    if "qkv_attention" in launchers:
        @torch.library.custom_op(lib + "qkv_attention", mutates_args=())
        def qkv_attention_op(x: Tensor, weight: Tensor, bias: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                             num_heads: int) -> Tensor:
            return launchers["qkv_attention"](x, weight, bias, cu_seqlens, max_seqlen, num_heads)

        qkv_attention_op.register_fake(lambda x, weight, bias, cu_seqlens, max_seqlen, num_heads: torch.empty_like(x))

        def qkv_attention(x, weight, bias, cu_seqlens, max_seqlen, num_heads, *, out=None):
            if out is not None or _eager(x, weight, bias):
                return launchers["qkv_attention"](x, weight, bias, cu_seqlens, max_seqlen, num_heads, out=out)
            return qkv_attention_op(x, weight, bias, cu_seqlens, max_seqlen, num_heads)

        ops["qkv_attention"] = qkv_attention

    if "attention_partials" in launchers:
        @torch.library.custom_op(lib + "attention_partials", mutates_args=())
        def attention_partials_op(x: Tensor, weight: Tensor, bias: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                                  num_heads: int, out_weight: Tensor) -> Tensor:
            return launchers["attention_partials"](x, weight, bias, cu_seqlens, max_seqlen, num_heads, out_weight)

        attention_partials_op.register_fake(lambda x, weight, bias, cu_seqlens, max_seqlen, num_heads, out_weight:
                                            x.new_empty((num_heads, *x.shape), dtype=torch.float32))

        def attention_partials(x, weight, bias, cu_seqlens, max_seqlen, num_heads, out_weight, *, out=None):
            if out is not None or _eager(x, weight, bias, out_weight):
                return launchers["attention_partials"](x, weight, bias, cu_seqlens, max_seqlen, num_heads, out_weight,
                                                       out=out)
            return attention_partials_op(x, weight, bias, cu_seqlens, max_seqlen, num_heads, out_weight)

        ops["attention_partials"] = attention_partials

    if "ffn_partials" in launchers:
        @torch.library.custom_op(lib + "ffn_partials", mutates_args=())
        def ffn_partials_op(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, splits: int, approximate: str) -> Tensor:
            return launchers["ffn_partials"](x, w1, b1, w2, splits, approximate)

        ffn_partials_op.register_fake(lambda x, w1, b1, w2, splits, approximate:
                                      x.new_empty((splits, *x.shape), dtype=torch.float32))

        def ffn_partials(x, w1, b1, w2, splits, approximate="none", *, out=None):
            if out is not None or _eager(x, w1, b1, w2):
                return launchers["ffn_partials"](x, w1, b1, w2, splits, approximate, out=out)
            return ffn_partials_op(x, w1, b1, w2, splits, approximate)

        ops["ffn_partials"] = ffn_partials

    if "partial_add_layer_norm" in launchers:
        @torch.library.custom_op(lib + "partial_add_layer_norm", mutates_args=())
        def partial_add_layer_norm_op(parts: Tensor, bias: Tensor | None, residual: Tensor, weight: Tensor,
                                      ln_bias: Tensor, eps: float) -> Tensor:
            return launchers["partial_add_layer_norm"](parts, bias, residual, weight, ln_bias, eps)

        partial_add_layer_norm_op.register_fake(lambda parts, bias, residual, weight, ln_bias, eps:
                                                torch.empty_like(residual))

        def partial_add_layer_norm(parts, bias, residual, weight, ln_bias, eps=1e-12, *, out=None):
            if out is not None or _eager(parts, bias, residual, weight, ln_bias):
                return launchers["partial_add_layer_norm"](parts, bias, residual, weight, ln_bias, eps, out=out)
            return partial_add_layer_norm_op(parts, bias, residual, weight, ln_bias, eps)

        ops["partial_add_layer_norm"] = partial_add_layer_norm
    return ops


def custom_ops(backend: str, launchers: Mapping[str, Callable]) -> dict[str, Callable]:
    """The registry-facing callables for a backend (custom ops defined once per process)."""
    if backend not in _cache:
        _cache[backend] = _define(backend, launchers)
    return _cache[backend]
