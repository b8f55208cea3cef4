"""The blocks no family owns, which the family files (model/bert.py, mpnet.py, gte.py, nomic_bert.py, modernbert.py,
qwen3.py) compose: LayerNorm parameters, embeddings, rotary frequencies, the gated feed-forward's pieces, the post-norm
layer of BERT and MPNet (its residual blocks and its FP8 step), the rotary gated layer of GTE and NomicBERT, the
encoder bases (the packed forward every family runs, the FP8 precision, the float32 rotary tables and the pre-norm
chain), and the decoder embedders' layer, stack and weight names. A family file imports no other family's: what two
of them share is here, where changing it visibly changes both. Parameter names here are the families' state_dict keys
(their WeightLayouts map checkpoints onto them)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fusedserve import kernels
from fusedserve.kernels import fp8, reference
from fusedserve.model import packing
from fusedserve.model.config import EncoderConfig, UnsupportedModel
from fusedserve.model.family import WeightLayout
from fusedserve.model.packing import FUSED_LAYER_TOKENS, OFFSET_ATTENTIONS, Packed, check_offsets


# ---- norms -------------------------------------------------------------------------------------------------------

def layer_norm_parameters(module: nn.Module, name: str, width: int, bias: bool = True) -> None:
    """A LayerNorm's weight `{name}_weight` (ones) and bias `{name}_bias` (zeros) on `module`: the bias a zero buffer
    where the model has none (ModernBERT's), so that the kernels take one signature."""
    module.register_parameter(f"{name}_weight", nn.Parameter(torch.ones(width)))
    if bias:
        module.register_parameter(f"{name}_bias", nn.Parameter(torch.zeros(width)))
    else:
        module.register_buffer(f"{name}_bias", torch.zeros(width), persistent=False)


# ---- embeddings --------------------------------------------------------------------------------------------------

class Embeddings(nn.Module):
    """LN(word[ids] + position[positions] + token_type[types]): learned absolute positions (BERT's, MPNet's)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.word_embeddings = nn.Parameter(torch.empty(config.vocab_size, h))
        self.position_embeddings = nn.Parameter(torch.empty(config.max_position_embeddings, h))
        self.token_type_embeddings = nn.Parameter(torch.empty(config.type_vocab_size, h))
        layer_norm_parameters(self, "ln", h)
        self.eps = config.layer_norm_eps

    def forward(self, input_ids: Tensor, position_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        # ids: [tokens] -> [tokens, hidden]
        return kernels.embedding_layer_norm(
            input_ids, position_ids, token_type_ids, self.word_embeddings, self.position_embeddings,
            self.token_type_embeddings, self.ln_weight, self.ln_bias, self.eps,
        )


class TokenTypeEmbeddings(nn.Module):
    """LN(word[ids] + token_type[types]) without a position table (rotary positions: GTE, NomicBERT, ModernBERT):
    the same embedding kernel with a one-row zero position table that every token reads. norm_bias: the norm has a
    bias (else a zero buffer)."""

    def __init__(self, config: EncoderConfig, norm_bias: bool = True) -> None:
        super().__init__()
        h = config.hidden_size
        self.word_embeddings = nn.Parameter(torch.empty(config.vocab_size, h))
        self.token_type_embeddings = nn.Parameter(torch.empty(config.type_vocab_size, h))
        self.register_buffer("position_embeddings", torch.zeros(1, h), persistent=False)
        layer_norm_parameters(self, "ln", h, norm_bias)
        self.eps = config.layer_norm_eps

    def forward(self, input_ids: Tensor, position_ids: Tensor | None, token_type_ids: Tensor) -> Tensor:
        return kernels.embedding_layer_norm(
            input_ids, torch.zeros_like(input_ids), token_type_ids, self.word_embeddings, self.position_embeddings,
            self.token_type_embeddings, self.ln_weight, self.ln_bias, self.eps,
        )


class TokenEmbeddings(nn.Module):
    """The token table alone: no positions (rotary), no token types, no norm (the decoders: Qwen)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))

    def forward(self, input_ids: Tensor, position_ids: Tensor | None, token_type_ids: Tensor | None) -> Tensor:
        return F.embedding(input_ids, self.word_embeddings)


# ---- rotary positions --------------------------------------------------------------------------------------------

def default_rope(hf: dict) -> dict:
    """A config.json's rope_parameters ({} where it has none), refusing scaled rotary embeddings by their type."""
    rope = hf.get("rope_parameters") or {}
    scaled = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaled:
        kind = scaled.get("rope_type") or scaled.get("type")
        raise UnsupportedModel(f"rotary embeddings of type {kind!r} are not supported (only the default, unscaled "
                               "rotary embedding)")
    return rope


def inverse_frequencies(theta: float, head_dim: int) -> Tensor:
    """transformers' default rotary frequencies: theta^(-2i/d) for i < d/2, float32."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


# ---- the gated feed-forward --------------------------------------------------------------------------------------

def glu_activation(name: str):
    """The gate's activation in plain torch (the padded test oracle)."""
    return {"gelu": F.gelu, "silu": F.silu}[name]


def linear_add_layer_norm(x: Tensor, linear: nn.Linear, residual: Tensor, weight: Tensor, bias: Tensor,
                          eps: float) -> Tensor:
    """LN(x W^T + b + residual), for a projection with or without its bias: without one, the cuBLAS GEMM and the
    add + LayerNorm kernel that kernels.linear_add_layer_norm is made of, called apart."""
    if linear.bias is not None:
        return kernels.linear_add_layer_norm(x, linear.weight, linear.bias, residual, weight, bias, eps)
    return kernels.add_layer_norm(F.linear(x, linear.weight), residual, None, weight, bias, eps)


# ---- post-norm layers --------------------------------------------------------------------------------------------

class PostNormLayer(nn.Module):
    """BERT's post-LN layer (BERT, MPNet): stacked q, k, v, the attention output, a GELU feed-forward, a LayerNorm
    after each residual add; its residual blocks on the fused ops and the same layer with its GEMMs in FP8. A family
    gives it its attention (`attend`) and its forwards."""

    FP8_GEMMS = ("qkv", "attn_out", "ffn_in", "ffn_out")

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.num_heads, self.eps = config.num_heads, config.layer_norm_eps
        self.qkv = nn.Linear(h, 3 * h)  # query, key, value stacked: one GEMM
        self.attn_out = nn.Linear(h, h)
        layer_norm_parameters(self, "attn_ln", h)
        self.ffn_in = nn.Linear(h, i)
        self.ffn_out = nn.Linear(i, h)
        layer_norm_parameters(self, "ffn_ln", h)

    def attend(self, qkv: Tensor, p: Packed, context) -> Tensor:
        """The attention of a packed batch from its stacked q, k, v [T, 3 hidden] -> [T, hidden]; context: what the
        encoder's layer_context gave this forward."""
        raise NotImplementedError

    def residual_blocks(self, x: Tensor, ctx: Tensor) -> Tensor:
        # post-LN residual blocks: x = LN(x + dense(ctx) + b); x = LN(x + W2 gelu(W1 x + b1) + b2). Each GEMM +
        # bias + residual + LayerNorm is one op (cuBLAS + the chosen backend's add_layer_norm kernel; a split GEMM +
        # LayerNorm kernel lost to that: docs/decisions/0001-split-gemm-layer-norm.md)
        x = kernels.linear_add_layer_norm(ctx, self.attn_out.weight, self.attn_out.bias, x, self.attn_ln_weight,
                                          self.attn_ln_bias, self.eps)
        # GELU(x W1^T + b1): one Triton GEMM with the bias + GELU epilogue, or cuBLAS + the bias_gelu kernel, as
        # the registry chose (self-test, then a race at [4096, 4 x hidden])
        h = kernels.linear_bias_gelu(x, self.ffn_in.weight, self.ffn_in.bias)
        return kernels.linear_add_layer_norm(h, self.ffn_out.weight, self.ffn_out.bias, x, self.ffn_ln_weight,
                                             self.ffn_ln_bias, self.eps)

    def forward_fp8(self, x: Tensor, xq: Tensor, xs: Tensor, p: Packed, context,
                    w: dict[str, fp8.QuantizedWeight]) -> tuple[Tensor, Tensor, Tensor]:
        """One layer with its four GEMMs in FP8 (PRECISION=fp8): x [T, hidden] and its row-quantized copy (xq,
        xs) in, the same three out. Biases before a LayerNorm or GELU go to that kernel; the QKV bias to the GEMM.
        Attention itself (`attend`, with the encoder's layer_context) stays in x's dtype."""
        dtype = x.dtype
        qkv = fp8.linear(xq, xs, w["qkv"], self.qkv.bias, dtype)
        ctx = self.attend(qkv, p, context)
        y = fp8.linear(*fp8.quantize_rows(ctx), w["attn_out"], None, dtype)
        x, xq, xs = fp8.add_layer_norm_quantize(y, x, self.attn_out.bias, self.attn_ln_weight, self.attn_ln_bias,
                                                self.eps)
        h = fp8.linear(xq, xs, w["ffn_in"], None, dtype)
        y = fp8.linear(*fp8.bias_gelu_quantize(h, self.ffn_in.bias), w["ffn_out"], None, dtype)
        return fp8.add_layer_norm_quantize(y, x, self.ffn_out.bias, self.ffn_ln_weight, self.ffn_ln_bias, self.eps)


class GluPostNormLayer(nn.Module):
    """GTE's layer (GTE, NomicBERT): BERT's post-LN blocks with rotary attention and a gated feed-forward, its
    projections with or without biases (config.linear_bias), the gate's activation config.hidden_act.

        x = LN(x + o_proj(attention(rotary(q), rotary(k), v)))
        x = LN(x + down_proj(act(x Wgate^T) * (x Wup^T)))
    """

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.linear_bias
        self.num_heads, self.eps, self.activation = config.num_heads, config.layer_norm_eps, config.hidden_act
        self.qkv = nn.Linear(h, 3 * h, bias=bias)
        self.attn_out = nn.Linear(h, h, bias=bias)
        layer_norm_parameters(self, "attn_ln", h)
        self.ffn_in = nn.Linear(h, 2 * i, bias=False)  # gate rows, then up rows
        self.ffn_out = nn.Linear(i, h, bias=bias)
        layer_norm_parameters(self, "ffn_ln", h)

    def forward(self, x: Tensor, batch: int, seq: int, attn_mask: Tensor, inv_freq: Tensor) -> Tensor:
        # the padded layout in plain torch (a test oracle, independent of the fused ops)
        qkv = F.linear(x, self.qkv.weight, self.qkv.bias)
        q, k, v = qkv.view(batch, seq, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        positions = torch.arange(seq, device=x.device)
        q, k = reference.rotate_half(q, positions, inv_freq), reference.rotate_half(k, positions, inv_freq)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask).transpose(1, 2).reshape(batch * seq, -1)
        x = F.layer_norm(x + F.linear(ctx, self.attn_out.weight, self.attn_out.bias), x.shape[-1:],
                         self.attn_ln_weight, self.attn_ln_bias, self.eps)
        gate, up = F.linear(x, self.ffn_in.weight).chunk(2, dim=-1)
        h = F.linear(glu_activation(self.activation)(gate) * up, self.ffn_out.weight, self.ffn_out.bias)
        return F.layer_norm(x + h, x.shape[-1:], self.ffn_ln_weight, self.ffn_ln_bias, self.eps)

    def forward_packed(self, x: Tensor, p: Packed, inv_freq: Tensor) -> Tensor:
        # kernels.rotary_attention rotates q and k as it loads them, kernels.linear_glu multiplies the activated gate
        # into the up half in the GEMM's epilogue: neither the rotated q, k nor the gate is written
        qkv = F.linear(x, self.qkv.weight, self.qkv.bias)
        ctx = kernels.rotary_attention(qkv, p.cu_seqlens, p.seq, self.num_heads, inv_freq)
        x = linear_add_layer_norm(ctx, self.attn_out, x, self.attn_ln_weight, self.attn_ln_bias, self.eps)
        h = kernels.linear_glu(x, self.ffn_in.weight, None, self.activation)
        return linear_add_layer_norm(h, self.ffn_out, x, self.ffn_ln_weight, self.ffn_ln_bias, self.eps)


# ---- encoders ----------------------------------------------------------------------------------------------------

class Encoder(nn.Module):
    """What every family's encoder is: `embeddings`, then `layers`, from `config`. A family's constructor builds
    them, adds what else it has, then calls reset_parameters. Its `forward` takes a padded [batch, seq] batch (the
    test oracle); the packed forward here runs the embeddings, then each layer's forward_packed(x, p, context), the
    context computed once per forward (layer_context)."""

    def __init__(self, config: EncoderConfig, embeddings: nn.Module, layers: Iterable[nn.Module]) -> None:
        super().__init__()
        self.config = config
        self.embeddings = embeddings
        self.layers = nn.ModuleList(layers)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """BERT's initialisation (normal(0, 0.02) matrices, zero biases, unit LayerNorm) from a fixed seed."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if "ln_weight" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)

    # an encoder whose layers attend over cu_seqlens whatever the mode (MPNet's relative and the rotary families'
    # fused attention ops; the modes then differ only in how the runner buckets graphs)
    attends_by_offsets = False

    def forward_packed(self, p: Packed, attention: str = "pad") -> Tensor:
        """Hidden states [T, hidden] of a packed batch (filler tokens' rows are garbage, never read)."""
        for x in self.packed_steps(p, attention):
            pass
        return x

    def packed_steps(self, p: Packed, attention: str = "pad") -> Iterator[Tensor]:
        """forward_packed one block at a time: the embeddings' output, then each layer's (the last is the hidden
        states), for a caller that does other work between blocks."""
        if attention in OFFSET_ATTENTIONS or self.attends_by_offsets:
            check_offsets(p, attention, self.embeddings.word_embeddings.dtype, f"{attention} attention")
        x = self.embeddings(p.input_ids, p.position_ids, p.token_type_ids)
        yield x
        yield from self.layer_steps(x, p, attention)

    def layer_steps(self, x: Tensor, p: Packed, attention: str) -> Iterator[Tensor]:
        """Each layer's output from the embeddings' x."""
        context = self.layer_context(attention)
        for layer in self.layers:
            x = layer.forward_packed(x, p, context)
            yield x

    def layer_context(self, attention: str):
        """What each layer's forward_packed takes besides x and the batch, computed once per forward: here the
        attention mode; a family whose layers need a per-forward table (MPNet's relative bias) returns that."""
        return attention


class PostNormEncoder(Encoder):
    """The encoder of PostNormLayers (BERT, MPNet), with the fp8 precision: each layer's GEMM weights in E4M3
    (quantize_fp8), kept beside the fp16 ones (the fp16 path is the fallback tier); not parameters or buffers, so
    .to(), .float() and the reference copy leave them out. `precision` "fp8": packed forwards under a fused selection
    run the layers' forward_fp8."""

    fp8_weights: list[dict[str, fp8.QuantizedWeight]] | None = None
    precision = "native"

    def quantize_fp8(self) -> int:
        """Quantize every layer's GEMM weights for the fp8 precision (once, on the device); returns their bytes."""
        if self.fp8_weights is None:
            self.fp8_weights = [{name: fp8.quantize_weight(getattr(layer, name).weight) for name in layer.FP8_GEMMS}
                                for layer in self.layers]
        return sum(w.nbytes for layer in self.fp8_weights for w in layer.values())

    def layer_steps(self, x: Tensor, p: Packed, attention: str) -> Iterator[Tensor]:
        fp8_attention = self._fp8_attention(x, attention)
        if fp8_attention is None:
            yield from super().layer_steps(x, p, attention)
            return
        context = self.layer_context(fp8_attention)
        xq, xs = fp8.quantize_rows(x)
        for layer, weights in zip(self.layers, self.fp8_weights):
            x, xq, xs = layer.forward_fp8(x, xq, xs, p, context, weights)
            yield x

    def _fp8_attention(self, x: Tensor, attention: str) -> str | None:
        """The attention mode of this forward's FP8 layers, or None where it runs in x's dtype: the fp8 precision
        off, the fused path off (the reference path, the verifier's copy: FP8 is part of the fused path) or a batch
        for the few-token layer (at <= FUSED_LAYER_TOKENS tokens its fp16 launches cost less than FP8 GEMMs, which
        lose to fp16 ones at such sizes: bench kernels gemm-fp8)."""
        if self.precision != "fp8" or not kernels.current().any_fused:
            return None
        if attention == "fused":
            if x.shape[0] <= FUSED_LAYER_TOKENS:
                return None
            return "varlen" if packing.varlen_runs(x.device, x.dtype) else "pad"
        return attention


class RotaryEncoder(Encoder):
    """An encoder with rotary positions (GTE, NomicBERT, ModernBERT, Qwen): `inv_freq` from config.rope_theta, kept
    float32 when the weights go to half precision (transformers keeps them so); its layers attend over cu_seqlens
    (kernels.rotary_attention) and take the frequencies as their context."""

    FLOAT32_BUFFERS: tuple[str, ...] = ("inv_freq",)
    attends_by_offsets = True

    def __init__(self, config: EncoderConfig, embeddings: nn.Module, layers: Iterable[nn.Module]) -> None:
        super().__init__(config, embeddings, layers)
        self.register_buffer("inv_freq", inverse_frequencies(config.rope_theta, config.head_dim), persistent=False)

    def _apply(self, fn, recurse=True):
        kept = {name: getattr(self, name) for name in self.FLOAT32_BUFFERS}
        module = super()._apply(fn, recurse)
        for name, buffer in kept.items():
            setattr(self, name, buffer.to(device=getattr(self, name).device))
        return module

    def frequencies(self, layer: nn.Module) -> Tensor:
        """The inverse frequencies `layer` rotates by (ModernBERT's sliding-window layers have their own)."""
        return self.inv_freq

    def layer_context(self, attention: str) -> Tensor:
        return self.inv_freq


class GluPostNormEncoder(RotaryEncoder):
    """GTE's encoder (GTE, NomicBERT): LN(word + token type) embeddings, then GluPostNormLayers."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__(config, TokenTypeEmbeddings(config),
                         (GluPostNormLayer(config) for _ in range(config.num_layers)))
        self.reset_parameters()

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        batch, seq = input_ids.shape
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.embeddings(input_ids.reshape(-1), None, token_type_ids.reshape(-1))
        attn_mask = attention_mask.bool()[:, None, None, :]
        for layer in self.layers:
            x = layer(x, batch, seq, attn_mask, self.inv_freq)
        return x.view(batch, seq, -1)


class PreNormEncoder(RotaryEncoder):
    """Pre-norm layers (ModernBERT, Qwen): each block's output joins the residual stream and the next block reads the
    norm of the sum, so one kernel adds and norms, with the next block's norm weights (the next layer's input norm,
    the final norm after the last layer). A layer's forward_packed(h, x, p, inv_freq, *next_norm) takes its normed
    input h and the stream x and returns (the next block's normed input, the stream); the steps yield the normed
    inputs, the last the hidden states."""

    def first_norm(self, x: Tensor) -> Tensor:
        """The first layer's normed input from the embeddings' output."""
        raise NotImplementedError

    def next_norms(self) -> list[tuple[Tensor, ...]]:
        """Per layer, the weights of the norm its output is read through (the next layer's input norm, the last
        layer's: the final norm), as its forward_packed takes them."""
        raise NotImplementedError

    def layer_steps(self, x: Tensor, p: Packed, attention: str) -> Iterator[Tensor]:
        h = self.first_norm(x)
        for layer, norm in zip(self.layers, self.next_norms()):
            h, x = layer.forward_packed(h, x, p, self.frequencies(layer), *norm)
            yield h


# ---- decoder layers ----------------------------------------------------------------------------------------------

class DecoderLayer(nn.Module):
    """The decoder embedders' layer (transformers' LlamaDecoderLayer and those that keep its shape: Qwen2's, Qwen3's,
    Mistral's), read once over each input: causal attention with grouped-query heads and rotary positions, RMSNorm
    before each block, a SwiGLU feed-forward.

        x = x + Wo(attention(rotary(norm_q(q)), rotary(norm_k(k)), v))   q, k, v = Wqkv(RMS_in(x)), causal, GQA
        x = x + Wdown(silu(x Wgate^T) * (x Wup^T))                       of RMS_post(x)

    Biases on the query, key and value projections alone where config.qkv_bias (Qwen2's); each head's q and k
    RMS-normed before the rotation where config.qk_norm (Qwen3's q_norm / k_norm). Its packed forward: one GEMM for q,
    k and v; kernels.rotary_attention norms, rotates and attends; kernels.add_rms_norm adds each block's output to the
    stream and norms the sum with the next block's weights; kernels.linear_glu multiplies silu(gate) into up in the
    GEMM's epilogue (gate rows first)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
        self.num_heads, self.kv_heads, self.head_dim = config.num_heads, config.kv_heads, d
        self.eps = config.layer_norm_eps
        self.in_ln_weight = nn.Parameter(torch.ones(h))
        self.qkv = nn.Linear(h, (self.num_heads + 2 * self.kv_heads) * d, bias=config.qkv_bias)
        if config.qk_norm:
            self.q_ln_weight = nn.Parameter(torch.ones(d))
            self.k_ln_weight = nn.Parameter(torch.ones(d))
        else:
            self.q_ln_weight = self.k_ln_weight = None
        self.attn_out = nn.Linear(self.num_heads * d, h, bias=False)
        self.post_ln_weight = nn.Parameter(torch.ones(h))
        self.ffn_in = nn.Linear(h, 2 * i, bias=False)  # gate rows, then up rows
        self.ffn_out = nn.Linear(i, h, bias=False)

    def forward(self, x: Tensor, batch: int, seq: int, attn_mask: Tensor, inv_freq: Tensor) -> Tensor:
        # the padded layout in plain torch (a test oracle, independent of the fused ops): x [batch * seq, hidden]
        rms = reference.rms_norm
        qkv = F.linear(rms(x, self.in_ln_weight, self.eps), self.qkv.weight, self.qkv.bias).view(batch, seq, -1,
                                                                                               self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.kv_heads, self.kv_heads], dim=2)
        if self.q_ln_weight is not None:
            q, k = rms(q, self.q_ln_weight, self.eps), rms(k, self.k_ln_weight, self.eps)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        positions = torch.arange(seq, device=x.device)
        q, k = reference.rotate_half(q, positions, inv_freq), reference.rotate_half(k, positions, inv_freq)
        group = self.num_heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask).transpose(1, 2).reshape(batch * seq, -1)
        x = x + F.linear(ctx, self.attn_out.weight)
        gate, up = F.linear(rms(x, self.post_ln_weight, self.eps), self.ffn_in.weight).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.ffn_out.weight)

    def forward_packed(self, h: Tensor, x: Tensor, p: Packed, inv_freq: Tensor, next_weight: Tensor
                       ) -> tuple[Tensor, Tensor]:
        """h = this layer's normed input, x the residual stream -> (the next block's normed input, the stream)."""
        qkv = F.linear(h, self.qkv.weight, self.qkv.bias)
        ctx = kernels.rotary_attention(qkv, p.cu_seqlens, p.seq, self.num_heads, inv_freq, 0, self.kv_heads, True,
                                       self.q_ln_weight, self.k_ln_weight, self.eps)
        h, x = kernels.add_rms_norm(F.linear(ctx, self.attn_out.weight), x, self.post_ln_weight, self.eps,
                                    return_sum=True)
        h = kernels.linear_glu(h, self.ffn_in.weight, None, "silu")
        return kernels.add_rms_norm(F.linear(h, self.ffn_out.weight), x, next_weight, self.eps, return_sum=True)


class DecoderEncoder(PreNormEncoder):
    """The decoder embedders' stack: the token table alone, DecoderLayers, a final RMSNorm (the hidden states). The
    sentence embedding is a token's hidden state (lasttoken pooling), so each input is read once, causally."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__(config, TokenEmbeddings(config), (DecoderLayer(config) for _ in range(config.num_layers)))
        self.final_ln_weight = nn.Parameter(torch.ones(config.hidden_size))
        self.reset_parameters()

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        batch, seq = input_ids.shape
        x = self.embeddings(input_ids.reshape(-1), None, None)
        positions = torch.arange(seq, device=input_ids.device)
        causal = (positions[None, :] <= positions[:, None])[None, None]
        # right padding: a padding query still sees its sequence's real keys before it (no empty softmax row)
        mask = causal & attention_mask.bool()[:, None, None, :]
        for layer in self.layers:
            x = layer(x, batch, seq, mask, self.inv_freq)
        return reference.rms_norm(x, self.final_ln_weight, self.config.layer_norm_eps).view(batch, seq, -1)

    def first_norm(self, x: Tensor) -> Tensor:
        return kernels.rms_norm(x, self.layers[0].in_ln_weight, self.config.layer_norm_eps)

    def next_norms(self) -> list[tuple[Tensor, ...]]:
        return [(layer.in_ln_weight,) for layer in self.layers[1:]] + [(self.final_ln_weight,)]


def decoder_kernel_ops(layout: str, attention: str, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    """The kernels.* ops DecoderEncoder's packed forward calls (the padded layout is plain torch)."""
    if layout != "packed":
        return ()
    return ("rms_norm", "rotary_attention", "add_rms_norm", "linear_glu")


# transformers' LlamaModel names, which Qwen2Model, Qwen3Model and MistralModel keep (a *ForCausalLM checkpoint's
# "model." prefix is stripped on load) -> DecoderLayer's; q/k norms only where the config has them (the encoder's
# state decides)
DECODER_WEIGHTS = WeightLayout(
    {"embed_tokens.weight": "embeddings.word_embeddings", "norm.weight": "final_ln_weight"},
    "layers.",
    {
        "input_layernorm.weight": "in_ln_weight",
        "self_attn.q_norm.weight": "q_ln_weight",
        "self_attn.k_norm.weight": "k_ln_weight",
        "self_attn.o_proj.weight": "attn_out.weight",
        "post_attention_layernorm.weight": "post_ln_weight",
        "mlp.down_proj.weight": "ffn_out.weight",
    },
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    stacked={"ffn_in.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")},
    optional=frozenset({"self_attn.q_norm.weight", "self_attn.k_norm.weight"}),
    token_types=False,
)
