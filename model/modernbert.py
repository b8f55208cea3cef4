"""The ModernBERT family (transformers' ModernBertModel: ModernBERT-base / -large, gte-modernbert, nomic-modernbert
and the Ettin-style fine-tunes): pre-norm layers without biases, rotary positions with one base for the global layers
and another for the sliding-window ones, a GeGLU feed-forward and a final norm.

    x = LN(word[ids])
    x = x + Wo(attention(rotary(q), rotary(k), v))     q, k, v = Wqkv(LN_attn(x)); no LN_attn in the first layer
    x = x + Wo'(gelu(x Wi_a^T) * (x Wi_b^T))           of LN_mlp(x)
    hidden = LN_final(x)

Every third layer (config.json's layer_types, else global_attn_every_n_layers) attends globally; the others attend
only to keys at most local_attention / 2 positions away (transformers' sliding_window), both through
kernels.rotary_attention, its window argument set for the local layers. Pre-norm means each block's output joins the
residual stream and the next block reads the norm of the sum: kernels.add_layer_norm does both in one pass
(return_sum), with the next block's norm weights: the next layer's attention norm, the feed-forward norm, the final
norm after the last layer (the pre-norm chain of model/layers.py's PreNormEncoder, which Qwen's encoder shares). Wi's
rows are the activated half then the gate (transformers chunks "input, gate"), the order kernels.linear_glu takes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fusedserve import kernels
from fusedserve.kernels import reference
from fusedserve.model import layers
from fusedserve.model.config import EncoderConfig, UnsupportedModel
from fusedserve.model.family import ClassifierHead, Family, WeightLayout
from fusedserve.model.packing import Packed

_LAYER_TYPES = ("full_attention", "sliding_attention")
_THETA = {"full_attention": ("global_rope_theta", 160_000.0), "sliding_attention": ("local_rope_theta", 10_000.0)}


def _rope_theta(hf: dict, kind: str) -> float:
    """A layer type's rotary base: transformers 5's rope_parameters by layer type, else the older global_rope_theta /
    local_rope_theta keys; scaled rotary embeddings are refused."""
    if hf.get("rope_scaling"):
        raise UnsupportedModel(f"rope_scaling {hf['rope_scaling']!r} is not supported (only the default, unscaled "
                               "rotary embedding)")
    key, default = _THETA[kind]
    params = (hf.get("rope_parameters") or {}).get(kind) or {}
    if params.get("rope_type", "default") != "default":
        raise UnsupportedModel(f"rotary embeddings of type {params['rope_type']!r} are not supported (only the "
                               "default, unscaled rotary embedding)")
    return float(params.get("rope_theta", hf.get(key, default)))


def _read_modernbert(hf: dict) -> dict:
    act = hf.get("hidden_activation", "gelu")
    if act != "gelu":
        raise UnsupportedModel(f"hidden_activation {act!r} is not supported (only exact GELU, 'gelu')")
    attention_bias, mlp_bias = hf.get("attention_bias", False), hf.get("mlp_bias", False)
    if attention_bias != mlp_bias:
        raise UnsupportedModel(f"attention_bias {attention_bias} with mlp_bias {mlp_bias} is not supported (both "
                               "or neither)")
    layers = hf["num_hidden_layers"]
    every = hf.get("global_attn_every_n_layers", 3)
    types = hf.get("layer_types") or ["sliding_attention" if i % every else "full_attention" for i in range(layers)]
    unknown = sorted(set(types) - set(_LAYER_TYPES))
    if unknown or len(types) != layers:
        raise UnsupportedModel(f"layer_types {types!r} are not supported ({layers} of {', '.join(_LAYER_TYPES)})")
    heads = hf["num_attention_heads"]
    positions = hf.get("max_position_embeddings", 8192)
    return dict(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=layers, num_heads=heads,
                intermediate_size=hf["intermediate_size"], type_vocab_size=1, layer_norm_eps=hf.get("norm_eps", 1e-5),
                pad_token_id=hf.get("pad_token_id") or 0, max_position_embeddings=positions,
                max_seq_length=positions, linear_bias=bool(attention_bias), norm_bias=bool(hf.get("norm_bias", False)),
                rope_theta=_rope_theta(hf, "full_attention"),
                sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
                sliding_window=hf.get("local_attention", 128) // 2,
                local_rope_theta=_rope_theta(hf, "sliding_attention"))


_MODERNBERT_WEIGHTS = WeightLayout(
    {
        "embeddings.tok_embeddings.weight": "embeddings.word_embeddings",
        "embeddings.token_type_embeddings.weight": "embeddings.token_type_embeddings",  # none: a zero row
        "embeddings.norm.weight": "embeddings.ln_weight",
        "embeddings.norm.bias": "embeddings.ln_bias",
        "final_norm.weight": "final_ln_weight",
        "final_norm.bias": "final_ln_bias",
    },
    "layers.",
    {
        "attn_norm.weight": "attn_ln_weight",
        "attn_norm.bias": "attn_ln_bias",
        "attn.Wqkv.weight": "qkv.weight",
        "attn.Wqkv.bias": "qkv.bias",
        "attn.Wo.weight": "attn_out.weight",
        "attn.Wo.bias": "attn_out.bias",
        "mlp_norm.weight": "ffn_ln_weight",
        "mlp_norm.bias": "ffn_ln_bias",
        "mlp.Wi.weight": "ffn_in.weight",
        "mlp.Wi.bias": "ffn_in.bias",
        "mlp.Wo.weight": "ffn_out.weight",
        "mlp.Wo.bias": "ffn_out.bias",
    },
    (),  # Wqkv is already stacked as query, key, value
    # the first layer has no attention norm; biases only where the config has them (the encoder's state decides)
    optional=frozenset({"attn_norm.weight", "embeddings.norm.bias", "final_norm.bias", "attn_norm.bias",
                        "attn.Wqkv.bias", "attn.Wo.bias", "mlp_norm.bias", "mlp.Wi.bias", "mlp.Wo.bias"}),
)


class Layer(nn.Module):
    def __init__(self, config: EncoderConfig, index: int) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.linear_bias
        self.num_heads, self.eps = config.num_heads, config.layer_norm_eps
        self.window = config.sliding_window if index in config.sliding_layers else 0
        self.first = index == 0
        if not self.first:  # the embeddings' norm stands for the first layer's
            layers.layer_norm_parameters(self, "attn_ln", h, config.norm_bias)
        self.qkv = nn.Linear(h, 3 * h, bias=bias)
        self.attn_out = nn.Linear(h, h, bias=bias)
        layers.layer_norm_parameters(self, "ffn_ln", h, config.norm_bias)
        self.ffn_in = nn.Linear(h, 2 * i, bias=bias)  # activated rows, then gate rows
        self.ffn_out = nn.Linear(i, h, bias=bias)

    def forward(self, x: Tensor, batch: int, seq: int, attn_mask: Tensor, inv_freq: Tensor) -> Tensor:
        # the padded layout in plain torch (a test oracle, independent of the fused ops)
        h = x if self.first else F.layer_norm(x, x.shape[-1:], self.attn_ln_weight, self.attn_ln_bias, self.eps)
        q, k, v = F.linear(h, self.qkv.weight, self.qkv.bias).view(batch, seq, 3, self.num_heads, -1).permute(
            2, 0, 3, 1, 4)
        positions = torch.arange(seq, device=x.device)
        q, k = reference.rotate_half(q, positions, inv_freq), reference.rotate_half(k, positions, inv_freq)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask).transpose(1, 2).reshape(batch * seq, -1)
        x = x + F.linear(ctx, self.attn_out.weight, self.attn_out.bias)
        h = F.layer_norm(x, x.shape[-1:], self.ffn_ln_weight, self.ffn_ln_bias, self.eps)
        a, gate = F.linear(h, self.ffn_in.weight, self.ffn_in.bias).chunk(2, dim=-1)
        return x + F.linear(F.gelu(a) * gate, self.ffn_out.weight, self.ffn_out.bias)

    def forward_packed(self, h: Tensor, x: Tensor, p: Packed, inv_freq: Tensor, next_weight: Tensor,
                       next_bias: Tensor) -> tuple[Tensor, Tensor]:
        """h = this layer's normed input, x the residual stream -> (the next block's normed input, the stream)."""
        qkv = F.linear(h, self.qkv.weight, self.qkv.bias)
        ctx = kernels.rotary_attention(qkv, p.cu_seqlens, p.seq, self.num_heads, inv_freq, self.window)
        h, x = kernels.add_layer_norm(F.linear(ctx, self.attn_out.weight), x, self.attn_out.bias, self.ffn_ln_weight,
                                      self.ffn_ln_bias, self.eps, return_sum=True)
        h = kernels.linear_glu(h, self.ffn_in.weight, self.ffn_in.bias, "gelu")
        return kernels.add_layer_norm(F.linear(h, self.ffn_out.weight), x, self.ffn_out.bias, next_weight, next_bias,
                                      self.eps, return_sum=True)


class Encoder(layers.PreNormEncoder):
    FLOAT32_BUFFERS = ("inv_freq", "local_inv_freq")

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__(config, layers.TokenTypeEmbeddings(config, norm_bias=config.norm_bias),
                         (Layer(config, i) for i in range(config.num_layers)))
        layers.layer_norm_parameters(self, "final_ln", config.hidden_size, config.norm_bias)
        local = config.local_rope_theta or config.rope_theta
        self.register_buffer("local_inv_freq", layers.inverse_frequencies(local, config.head_dim), persistent=False)
        self.reset_parameters()

    def frequencies(self, layer: Layer) -> Tensor:
        return self.local_inv_freq if layer.window else self.inv_freq

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        batch, seq = input_ids.shape
        ids = input_ids.reshape(-1)
        x = self.embeddings(ids, None, torch.zeros_like(ids))
        positions = torch.arange(seq, device=input_ids.device)
        # the mask is over keys: a query of a masked position still attends to the others (a ColBERT query's
        # expansion tokens). A query with no key at all (padding beyond a sliding window) attends to itself: a row
        # of SDPA's mask without any key is NaN, and a NaN value row poisons every query that gives it weight 0
        itself = (positions[None, :] == positions[:, None])[None, None]
        keep = attention_mask.bool()[:, None, None, :].expand(batch, 1, seq, seq)
        near = keep & ((positions[None, :] - positions[:, None]).abs() <= self.config.sliding_window)[None, None]
        keep, near = (mask | (itself & ~mask.any(-1, keepdim=True)) for mask in (keep, near))
        for layer in self.layers:
            x = layer(x, batch, seq, near if layer.window else keep, self.frequencies(layer))
        x = F.layer_norm(x, x.shape[-1:], self.final_ln_weight, self.final_ln_bias, self.config.layer_norm_eps)
        return x.view(batch, seq, -1)

    def first_norm(self, x: Tensor) -> Tensor:
        return x  # the embeddings' norm stands for the first layer's attention norm

    def next_norms(self) -> list[tuple[Tensor, ...]]:
        norms = [(layer.attn_ln_weight, layer.attn_ln_bias) for layer in self.layers[1:]]
        return norms + [(self.final_ln_weight, self.final_ln_bias)]


def kernel_ops(layout: str, attention: str, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    ops = ["embedding_layer_norm"]
    if layout == "packed":
        ops += ["rotary_attention", "add_layer_norm", "linear_glu", "segment_mean"]
    return tuple(ops)


# sequence classifiers: cls or mean pooling (classifier_pooling), dense, GELU, a LayerNorm, then the classifier
MODERNBERT = Family("modernbert", ("modernbert",), "ModernBERT", _read_modernbert, _MODERNBERT_WEIGHTS,
                    ClassifierHead("head.dense", "gelu", "classifier", norm="head.norm",
                                   pooling_key="classifier_pooling"),
                    encoder=Encoder, kernel_ops=kernel_ops, positions="rotary, global and sliding-window",
                    few_token_layer=False, gated_ffn=True)
FAMILIES = (MODERNBERT,)
