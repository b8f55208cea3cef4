"""The Qwen3 and Qwen2 families as embedders (transformers' Qwen3Model / Qwen2Model: Qwen3-Embedding, and the
Qwen2-based embedders served the way their config declares): decoder layers read once over each input, causal
attention with grouped-query heads, rotary positions, RMSNorm before each block and a SwiGLU feed-forward.

    x = embed[ids]
    x = x + Wo(attention(rotary(norm_q(q)), rotary(norm_k(k)), v))   q, k, v = Wqkv(RMS_in(x)), causal, GQA
    x = x + Wdown(silu(x Wgate^T) * (x Wup^T))                       of RMS_post(x)
    hidden = RMS_final(x)

Qwen3 RMS-norms each head of q and k before the rotation (q_norm, k_norm); Qwen2 has neither, and biases on its query,
key and value projections. The layers are model/layers.py's DecoderEncoder (Llama's shape, which Qwen keeps), its
weight names DECODER_WEIGHTS. Pre-norm as ModernBERT (model/layers.py's PreNormEncoder): each block's output joins the
residual stream and the next block reads the RMSNorm of the sum, so kernels.add_rms_norm does both in one pass
(return_sum), with the next block's weights (the post-attention norm, the next layer's input norm, the final norm
after the last layer); kernels.rotary_attention norms, rotates and attends; kernels.linear_glu multiplies silu(gate)
into up in the GEMM's epilogue (gate rows first, as GTE's). The sentence embedding is the last token's hidden state
(sentence-transformers' `lasttoken` pooling). Sliding-window layers, attention biases on the output projection, scaled
rotary embeddings and custom code (`auto_map`: gte-Qwen2's makes the attention bidirectional) are refused by name.

Qwen3-Reranker (a Qwen3ForCausalLM directory) is served as the family's YesNoReranker (model/family.py): its model
card's prompt template, the score from the "yes" and "no" rows of the LM head at the last token (model/modules.py)."""

from __future__ import annotations

import torch

from fusedserve.model import layers
from fusedserve.model.config import UnsupportedModel
from fusedserve.model.family import Family, YesNoReranker


def _read(hf: dict, *, qwen3: bool) -> dict:
    label = "Qwen3" if qwen3 else "Qwen2"
    if hf.get("auto_map"):
        raise UnsupportedModel(f"a {label} config with custom code (auto_map: {sorted(hf['auto_map'].values())[:2]}) "
                               "is not supported: its code may change the attention (gte-Qwen2's attends both ways), "
                               f"and only transformers' {label}Model is served")
    if hf.get("is_causal", True) is not True:
        raise UnsupportedModel(f"is_causal {hf['is_causal']!r} is not supported ({label} with causal attention only)")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"hidden_act {act!r} is not supported ({label} with a SiLU gate only)")
    types = set(hf.get("layer_types") or ())
    if hf.get("use_sliding_window") or types - {"full_attention"}:
        raise UnsupportedModel(f"sliding-window attention (use_sliding_window, layer_types {sorted(types)}) is not "
                               f"supported ({label} with full attention in every layer only)")
    if qwen3 and hf.get("attention_bias", False):
        raise UnsupportedModel("attention_bias true is not supported (Qwen3 without attention biases only)")
    rope = layers.default_rope(hf)
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    head_size = hf.get("head_dim") or hidden // heads
    positions = hf.get("max_position_embeddings", 32768)
    return dict(vocab_size=hf["vocab_size"], hidden_size=hidden, num_layers=hf["num_hidden_layers"], num_heads=heads,
                num_kv_heads=hf.get("num_key_value_heads") or heads, head_size=head_size,
                intermediate_size=hf["intermediate_size"], type_vocab_size=1,
                layer_norm_eps=hf.get("rms_norm_eps", 1e-6),
                pad_token_id=hf.get("pad_token_id") or 0, max_position_embeddings=positions, max_seq_length=positions,
                rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 1_000_000.0 if qwen3 else 10_000.0))),
                hidden_act="silu", linear_bias=False, norm_bias=False, qkv_bias=not qwen3, qk_norm=qwen3)


# Qwen3-Reranker's template, as its model card's code writes it
QWEN3_RERANKER = YesNoReranker(
    prefix="<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
           "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n",
    body="<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}",
    suffix="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    instruction="Given a web search query, retrieve relevant passages that answer the query")

_COMMON = dict(encoder=layers.DecoderEncoder, kernel_ops=layers.decoder_kernel_ops, pooling=("lasttoken",),
               attention="causal grouped-query", few_token_layer=False, gated_ffn=True, dtype_on_cuda=torch.bfloat16)
QWEN3 = Family("qwen3", ("qwen3",), "Qwen3", lambda hf: _read(hf, qwen3=True), layers.DECODER_WEIGHTS, None,
               positions="rotary", reranker=QWEN3_RERANKER, **_COMMON)
QWEN2 = Family("qwen2", ("qwen2",), "Qwen2", lambda hf: _read(hf, qwen3=False), layers.DECODER_WEIGHTS, None,
               positions="rotary", **_COMMON)
FAMILIES = (QWEN3, QWEN2)
