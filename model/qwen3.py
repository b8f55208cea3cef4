"""The Qwen3 and Qwen2 families as embedders (transformers' Qwen3Model / Qwen2Model: Qwen3-Embedding, and the
Qwen2-based embedders served the way their config declares): decoder layers read once over each input, causal
attention with grouped-query heads, rotary positions, RMSNorm before each block and a SwiGLU feed-forward.

    x = embed[ids]
    x = x + Wo(attention(rotary(norm_q(q)), rotary(norm_k(k)), v))   q, k, v = Wqkv(RMS_in(x)), causal, GQA
    x = x + Wdown(silu(x Wgate^T) * (x Wup^T))                       of RMS_post(x)
    hidden = RMS_final(x)

Qwen3 RMS-norms each head of q and k before the rotation (q_norm, k_norm); Qwen2 has neither, and biases on its query,
key and value projections. Pre-norm as ModernBERT (model/layers.py's PreNormEncoder): each block's output joins the
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
import torch.nn.functional as F
from torch import Tensor, nn

from fusedserve import kernels
from fusedserve.kernels import reference
from fusedserve.model import layers
from fusedserve.model.config import EncoderConfig, UnsupportedModel
from fusedserve.model.family import Family, WeightLayout, YesNoReranker
from fusedserve.model.packing import Packed


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


_LAYER = {
    "input_layernorm.weight": "in_ln_weight",
    "self_attn.q_norm.weight": "q_ln_weight",
    "self_attn.k_norm.weight": "k_ln_weight",
    "self_attn.o_proj.weight": "attn_out.weight",
    "post_attention_layernorm.weight": "post_ln_weight",
    "mlp.down_proj.weight": "ffn_out.weight",
}
# transformers' Qwen3Model / Qwen2Model names (a *ForCausalLM checkpoint's "model." prefix is stripped on load);
# q/k norms only where the config has them (the encoder's state decides)
_WEIGHTS = WeightLayout(
    {"embed_tokens.weight": "embeddings.word_embeddings", "norm.weight": "final_ln_weight"},
    "layers.",
    _LAYER,
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    stacked={"ffn_in.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")},
    optional=frozenset({"self_attn.q_norm.weight", "self_attn.k_norm.weight"}),
    token_types=False,
)


class Layer(nn.Module):
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


class Encoder(layers.PreNormEncoder):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__(config, layers.TokenEmbeddings(config), (Layer(config) for _ in range(config.num_layers)))
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


def kernel_ops(layout: str, attention: str, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    if layout != "packed":
        return ()
    return ("rms_norm", "rotary_attention", "add_rms_norm", "linear_glu")


# Qwen3-Reranker's template, as its model card's code writes it
QWEN3_RERANKER = YesNoReranker(
    prefix="<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
           "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n",
    body="<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}",
    suffix="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    instruction="Given a web search query, retrieve relevant passages that answer the query")

_COMMON = dict(encoder=Encoder, kernel_ops=kernel_ops, pooling=("lasttoken",), attention="causal grouped-query",
               few_token_layer=False, gated_ffn=True, dtype_on_cuda=torch.bfloat16)
QWEN3 = Family("qwen3", ("qwen3",), "Qwen3", lambda hf: _read(hf, qwen3=True), _WEIGHTS, None,
               positions="rotary", reranker=QWEN3_RERANKER, **_COMMON)
QWEN2 = Family("qwen2", ("qwen2",), "Qwen2", lambda hf: _read(hf, qwen3=False), _WEIGHTS, None,
               positions="rotary", **_COMMON)
FAMILIES = (QWEN3, QWEN2)
