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
written either. NomicBERT runs the same layers: they are model/layers.py's GluPostNormEncoder; this file reads GTE's
config.json and checkpoint layouts."""

from __future__ import annotations

import torch
from torch import Tensor

from fusedserve.model import layers
from fusedserve.model.config import UnsupportedModel
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
    rope = layers.default_rope(hf)
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


def kernel_ops(layout: str, attention: str, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    ops = ["embedding_layer_norm"]
    if layout == "packed":
        ops += ["rotary_attention", "linear_add_layer_norm", "linear_glu", "segment_mean"]
    return tuple(ops)


GTE = Family("gte", ("gte", "new"), "GTE", _read_gte, _GTE_WEIGHTS, ClassifierHead("pooler.dense", "tanh", "classifier"),
             encoder=layers.GluPostNormEncoder, kernel_ops=kernel_ops, positions="rotary", few_token_layer=False,
             gated_ffn=True)
FAMILIES = (GTE,)
