"""The NomicBERT family (transformers' NomicBertModel: nomic-embed-text-v1 / v1.5 and nomic-bert-2048, also as
released, with Nomic's custom code): GTE's layers with a SiLU gate (SwiGLU) and no biases in any projection.

    x = LN(word[ids] + token_type[types])          (no position table)
    x = LN(x + o_proj(attention(rotary(q), rotary(k), v)))
    x = LN(x + down_proj(silu(x Wgate^T) * (x Wup^T)))

The layers are GTE's, model/layers.py's GluPostNormEncoder (rotary attention and the gated feed-forward on
kernels.rotary_attention and kernels.linear_glu); this file reads the two config.json and checkpoint layouts. The
released checkpoints' config is Nomic's GPT-2 style one (n_embd, n_layer, activation_function "swiglu", rotary_emb_*;
auto_map to its code) and their tensors are named as that code names them (encoder.layers.{i}.attn.Wqkv, mlp.fc11 /
fc12 / fc2, norm1 / norm2, emb_ln); transformers 5.24 renames both at load, and so does this file. Switches of the
custom code that change the math (pre-norm, partial or interleaved or scaled rotary embeddings, biases, causal
attention, RMSNorm) are refused by name."""

from __future__ import annotations

import torch
from torch import Tensor

from fusedserve.model import layers
from fusedserve.model.config import UnsupportedModel
from fusedserve.model.family import ClassifierHead, Family, WeightLayout, released_layer_names

_ACTIVATIONS = {"silu": "silu", "swiglu": "silu", "gelu": "gelu", "geglu": "gelu"}
# Nomic's custom config (a GPT2Config): its switches that change the math, and the value that keeps it transformers'
# NomicBertModel. The biases default to on there: a released config turns them off by name.
_CUSTOM_CODE_MATH = {"prenorm": False, "parallel_block": False, "rotary_emb_fraction": 1.0,
                     "rotary_emb_interleaved": False, "rotary_emb_scale_base": None, "rotary_scaling_factor": None,
                     "qkv_proj_bias": True, "mlp_fc1_bias": True, "mlp_fc2_bias": True, "use_rms_norm": False,
                     "causal": False, "scale_attn_weights": True}
_PLAIN = {"qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False}


def _read_custom(hf: dict) -> dict:
    """Nomic's GPT-2 style config.json -> transformers' NomicBertConfig keys."""
    for key, default in _CUSTOM_CODE_MATH.items():
        plain = _PLAIN.get(key, default)
        if hf.get(key, default) != plain:
            raise UnsupportedModel(f"{key} {hf.get(key, default)!r} is not supported (NomicBERT with {key} "
                                   f"{plain!r} only)")
    if hf.get("n_inner") is None:
        raise UnsupportedModel("a NomicBERT config without n_inner (the feed-forward width) is not supported")
    return dict(vocab_size=hf["vocab_size"], hidden_size=hf["n_embd"], num_hidden_layers=hf["n_layer"],
                num_attention_heads=hf["n_head"], intermediate_size=hf["n_inner"],
                hidden_act=hf.get("activation_function", "swiglu"), max_position_embeddings=hf.get("n_positions", 2048),
                type_vocab_size=hf.get("type_vocab_size", 2), layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                pad_token_id=hf.get("pad_token_id", 0), rope_theta=hf.get("rotary_emb_base", 1000.0))


def _read_nomic_bert(hf: dict) -> dict:
    if "n_embd" in hf:
        hf = _read_custom(hf)
    act = hf.get("hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise UnsupportedModel(f"hidden_act {act!r} is not supported (NomicBERT with a SiLU or GELU gate only)")
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
        kind = rope.get("rope_type") or (hf.get("rope_scaling") or {}).get("rope_type")
        raise UnsupportedModel(f"rotary embeddings of type {kind!r} are not supported (only the default, unscaled "
                               "rotary embedding)")
    heads = hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, hf["hidden_size"] // heads):
        raise UnsupportedModel(f"head_dim {hf['head_dim']} other than hidden_size / num_attention_heads")
    positions = hf.get("max_position_embeddings", 2048)
    return dict(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
                num_heads=heads, intermediate_size=hf["intermediate_size"], hidden_act=_ACTIVATIONS[act],
                linear_bias=False, type_vocab_size=max(hf.get("type_vocab_size", 2), 1),
                layer_norm_eps=hf.get("layer_norm_eps", 1e-12), pad_token_id=hf.get("pad_token_id") or 0,
                max_position_embeddings=positions, max_seq_length=positions,
                rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 1000.0))))


_HUB_NAMES = {"attn.out_proj.": "self_attn.o_proj.", "mlp.fc11.": "mlp.up_proj.", "mlp.fc12.": "mlp.gate_proj.",
              "mlp.fc2.": "mlp.down_proj.", "norm1.": "post_attention_layernorm.", "norm2.": "post_mlp_layernorm."}


def _from_hub_layout(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Nomic's released layout (emb_ln, encoder.layers.{i}, a fused attn.Wqkv, mlp.fc11 = up, fc12 = gate) ->
    transformers' NomicBertModel names."""
    renamed = {("embeddings.LayerNorm." + k[len("emb_ln."):] if k.startswith("emb_ln.") else k): t
               for k, t in tensors.items()}
    return released_layer_names(renamed, "encoder.layers.", "attn.Wqkv.", _HUB_NAMES)


# transformers' NomicBertModel names (GteModel's, without the projections' biases)
_NOMIC_WEIGHTS = WeightLayout(
    {
        "embeddings.word_embeddings.weight": "embeddings.word_embeddings",
        "embeddings.token_type_embeddings.weight": "embeddings.token_type_embeddings",
        "embeddings.LayerNorm.weight": "embeddings.ln_weight",
        "embeddings.LayerNorm.bias": "embeddings.ln_bias",
    },
    "layers.",
    {
        "self_attn.o_proj.weight": "attn_out.weight",
        "post_attention_layernorm.weight": "attn_ln_weight",
        "post_attention_layernorm.bias": "attn_ln_bias",
        "mlp.down_proj.weight": "ffn_out.weight",
        "post_mlp_layernorm.weight": "ffn_ln_weight",
        "post_mlp_layernorm.bias": "ffn_ln_bias",
    },
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    stacked={"ffn_in.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")},
    rename=_from_hub_layout,
)


def kernel_ops(layout: str, attention: str, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    ops = ["embedding_layer_norm"]
    if layout == "packed":  # projections without a bias: cuBLAS, then the add + LayerNorm kernel
        ops += ["rotary_attention", "add_layer_norm", "linear_glu", "segment_mean"]
    return tuple(ops)


NOMIC_BERT = Family("nomic_bert", ("nomic_bert",), "NomicBERT", _read_nomic_bert, _NOMIC_WEIGHTS,
                    ClassifierHead("pooler.dense", "tanh", "classifier"), encoder=layers.GluPostNormEncoder,
                    kernel_ops=kernel_ops, positions="rotary", few_token_layer=False, gated_ffn=True)
FAMILIES = (NOMIC_BERT,)
