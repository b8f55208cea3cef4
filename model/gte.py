"""The GTE family (transformers' GteModel: gte-multilingual-base and the gte-*-v1.5 encoders, also as released, with
Alibaba-NLP's custom code: model_type "new"): BERT's post-LN layers with rotary position embeddings in place of
learned absolute ones and a gated GELU feed-forward.

    x = LN(word[ids] + token_type[types])          (no position table)
    x = LN(x + o_proj(attention(rotary(q), rotary(k), v)))
    x = LN(x + down_proj(gelu(x Wgate^T) * (x Wup^T)))

Rotary embeddings rotate each head's query and key by their token's position within its sequence (0-based), pairing
dimension i with i + d/2 (transformers' rotate_half); kernels.rotary_attention applies them as it loads q and k,
so the rotated q and k are never written. The gate and up projections are stacked into one [2I, H] weight and
kernels.linear_glu multiplies the activated gate half into the up half in the GEMM's epilogue: the gate is never
written either."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fusedserve import kernels
from fusedserve.kernels import reference
from fusedserve.model import bert
from fusedserve.model.config import EncoderConfig, UnsupportedModel
from fusedserve.model.encoder import Packed
from fusedserve.model.family import ClassifierHead, Family, WeightLayout, released_layer_names


# The released checkpoints' config.json (Alibaba-NLP's custom code, model_type "new"): switches of that code which
# change the math, and the value that keeps it transformers' GteModel
_CUSTOM_CODE_MATH = {"position_embedding_type": "rope", "layer_norm_type": "layer_norm",
                     "logn_attention_scale": False, "logn_attention_clip1": False}


def _read_gte(hf: dict) -> dict:
    act = hf.get("hidden_act", "gelu")
    if act != "gelu":
        raise UnsupportedModel(f"hidden_act {act!r} is not supported (only exact GELU, 'gelu')")
    for key, plain in _CUSTOM_CODE_MATH.items():
        if hf.get(key, plain) != plain:
            raise UnsupportedModel(f"{key} {hf[key]!r} is not supported (GTE with {key} {plain!r} only)")
    rope = default_rope(hf)
    heads = hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, hf["hidden_size"] // heads):
        raise UnsupportedModel(f"head_dim {hf['head_dim']} other than hidden_size / num_attention_heads")
    positions = hf.get("max_position_embeddings", 8192)
    return dict(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
                num_heads=heads, intermediate_size=hf["intermediate_size"],
                # gte-base-en-v1.5 has no token types (0): one all-zero row (model.weights)
                type_vocab_size=max(hf.get("type_vocab_size", 1), 1), layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
                pad_token_id=hf.get("pad_token_id", 1) if hf.get("pad_token_id") is not None else 0,
                max_position_embeddings=positions, max_seq_length=positions,
                rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 160_000.0))))


_HUB_NAMES = {"attention.o_proj.": "self_attn.o_proj.", "attn_ln.": "post_attention_layernorm.",
              "mlp_ln.": "post_mlp_layernorm."}


def _from_hub_layout(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The layout GTE checkpoints ship in (Alibaba-NLP's custom code, model type "new"; transformers saves GteModel
    in it too): `new.` prefix, encoder.layer.{i}, a fused attention.qkv_proj and mlp.up_gate_proj with the up rows
    FIRST -> transformers' GteModel names."""
    return released_layer_names({k.removeprefix("new."): t for k, t in tensors.items()}, "encoder.layer.",
                                "attention.qkv_proj.", _HUB_NAMES,
                                {"mlp.up_gate_proj.weight": ("mlp.up_proj.weight", "mlp.gate_proj.weight")})


_GTE_WEIGHTS = WeightLayout(
    {
        "embeddings.word_embeddings.weight": "embeddings.word_embeddings",
        "embeddings.token_type_embeddings.weight": "embeddings.token_type_embeddings",
        "embeddings.LayerNorm.weight": "embeddings.ln_weight",
        "embeddings.LayerNorm.bias": "embeddings.ln_bias",
    },
    "layers.",
    {
        "self_attn.o_proj.weight": "attn_out.weight",
        "self_attn.o_proj.bias": "attn_out.bias",
        "post_attention_layernorm.weight": "attn_ln_weight",
        "post_attention_layernorm.bias": "attn_ln_bias",
        "mlp.down_proj.weight": "ffn_out.weight",
        "mlp.down_proj.bias": "ffn_out.bias",
        "post_mlp_layernorm.weight": "ffn_ln_weight",
        "post_mlp_layernorm.bias": "ffn_ln_bias",
    },
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    stacked={"ffn_in.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")},
    rename=_from_hub_layout,
)


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


class Embeddings(bert.Embeddings):
    """LN(word + token type): BERT's embedding kernel with a one-row zero position table that every token reads."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__(config.replace(max_position_embeddings=1, max_seq_length=1))
        del self.position_embeddings
        self.register_buffer("position_embeddings", torch.zeros(1, config.hidden_size), persistent=False)

    def forward(self, input_ids: Tensor, position_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        return super().forward(input_ids, torch.zeros_like(input_ids), token_type_ids)


class Layer(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.linear_bias
        self.num_heads, self.eps, self.activation = config.num_heads, config.layer_norm_eps, config.hidden_act
        self.qkv = nn.Linear(h, 3 * h, bias=bias)
        self.attn_out = nn.Linear(h, h, bias=bias)
        self.attn_ln_weight = nn.Parameter(torch.ones(h))
        self.attn_ln_bias = nn.Parameter(torch.zeros(h))
        self.ffn_in = nn.Linear(h, 2 * i, bias=False)  # gate rows, then up rows
        self.ffn_out = nn.Linear(i, h, bias=bias)
        self.ffn_ln_weight = nn.Parameter(torch.ones(h))
        self.ffn_ln_bias = nn.Parameter(torch.zeros(h))

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
        qkv = F.linear(x, self.qkv.weight, self.qkv.bias)
        ctx = kernels.rotary_attention(qkv, p.cu_seqlens, p.seq, self.num_heads, inv_freq)
        x = linear_add_layer_norm(ctx, self.attn_out, x, self.attn_ln_weight, self.attn_ln_bias, self.eps)
        h = kernels.linear_glu(x, self.ffn_in.weight, None, self.activation)
        return linear_add_layer_norm(h, self.ffn_out, x, self.ffn_ln_weight, self.ffn_ln_bias, self.eps)


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


class Encoder(bert.Encoder):
    def __init__(self, config: EncoderConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_layers))
        self.register_buffer("inv_freq", inverse_frequencies(config.rope_theta, config.head_dim), persistent=False)
        self.reset_parameters()

    # the rotary frequencies stay float32 when the weights go to half precision (transformers keeps them so)
    FLOAT32_BUFFERS = ("inv_freq",)

    def _apply(self, fn, recurse=True):
        kept = {name: getattr(self, name) for name in self.FLOAT32_BUFFERS}
        module = super()._apply(fn, recurse)
        for name, buffer in kept.items():
            setattr(self, name, buffer.to(device=getattr(self, name).device))
        return module

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        batch, seq = input_ids.shape
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.embeddings(input_ids.reshape(-1), None, token_type_ids.reshape(-1))
        attn_mask = attention_mask.bool()[:, None, None, :]
        for layer in self.layers:
            x = layer(x, batch, seq, attn_mask, self.inv_freq)
        return x.view(batch, seq, -1)

    attends_by_offsets = True  # rotary_attention works from cu_seqlens on every device

    def layer_context(self, attention: str) -> Tensor:
        return self.inv_freq


def kernel_ops(layout: str, attention: str, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    ops = ["embedding_layer_norm"]
    if layout == "packed":
        ops += ["rotary_attention", "linear_add_layer_norm", "linear_glu", "segment_mean"]
    return tuple(ops)


GTE = Family("gte", ("gte", "new"), "GTE", _read_gte, _GTE_WEIGHTS, ClassifierHead("pooler.dense", "tanh", "classifier"),
             encoder=Encoder, kernel_ops=kernel_ops, positions="rotary", few_token_layer=False, gated_ffn=True)
FAMILIES = (GTE,)
