"""EmbeddingGemma: transformers' Gemma3TextModel (model_type gemma3_text) with `use_bidirectional_attention`, as
google/embeddinggemma-300m ships it, then sentence-transformers' mean pooling, two Dense modules and Normalize
(model/modules.py reads those and the query / document prompts).

    x = embed[ids] * sqrt(hidden)                      the scale rounded to the model dtype, as transformers does
    x = x + RMS_post_attn(Wo(attention(rotary(s * RMS_q(q)), rotary(RMS_k(k)), v)))   q, k, v = Wqkv(RMS_in(x))
    x = x + RMS_post_ffn(Wdown(gelu_tanh(h Wgate^T) * (h Wup^T)))                    h = RMS_pre_ffn(x)
    hidden = RMS_final(x)

Every RMSNorm is Gemma's, x * (1 + w) in float32 then rounded to the model dtype (gemma_rms_norm); q and k are
normed per head. Attention attends both ways with grouped-query heads. config.json's `layer_types` make each layer
a global one (every key, rotary base rope_theta) or a sliding-window one (rotary base rope_local_base_freq): in
those a query sees the keys less than `sliding_window // 2 + 1` positions away on either side (transformers halves
the configured window for bidirectional attention), i.e. at most sliding_window // 2 away, which is
kernels.rotary_attention's `window`. Scores are scaled by query_pre_attn_scalar^-0.5 where rotary_attention scales
by head_dim^-0.5, so q carries the ratio of the two (1 for EmbeddingGemma's 256 and 256).

The reference path: the norms, the scaled embedding and the tanh-GELU gate are plain torch here (no kernel op takes
Gemma's (1 + w) norm or the tanh gate); the attention is kernels.rotary_attention. EmbeddingGemma's card supports
float32 and bfloat16, not float16 (its activations outgrow float16's range): bfloat16 is the default on a GPU and a
float16 encoder is refused by name. Causal Gemma3 (use_bidirectional_attention false), attention biases, attention
logit soft-capping, scaled rotary embeddings, another activation and custom code are refused by name."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fusedserve import kernels
from fusedserve.kernels import reference
from fusedserve.model import layers
from fusedserve.model.config import EncoderConfig, UnsupportedModel
from fusedserve.model.family import Family, WeightLayout
from fusedserve.model.packing import Packed

_LAYER_TYPES = ("full_attention", "sliding_attention")
# transformers' Gemma3TextConfig defaults, for what a config.json leaves out
_DEFAULTS = dict(num_key_value_heads=4, head_dim=256, max_position_embeddings=131_072, rms_norm_eps=1e-6,
                 query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=6)
_THETA = {"full_attention": ("rope_theta", 1_000_000.0), "sliding_attention": ("rope_local_base_freq", 10_000.0)}


@dataclass(frozen=True)
class Gemma3Attention:
    """Gemma3's own attention setting (EncoderConfig.section): scores scaled by query_pre_attn_scalar^-0.5."""

    query_pre_attn_scalar: float


def _rope_theta(hf: dict, layer_type: str) -> float:
    """A layer type's rotary base: transformers 5's per-type rope_parameters, else transformers 4's top-level
    rope_theta / rope_local_base_freq; scaled rotary embeddings refused by their type."""
    key, default = _THETA[layer_type]
    rope = hf.get("rope_parameters") or {}
    if hf.get("rope_scaling"):
        rope = {"full_attention": hf["rope_scaling"]}
    params = rope.get(layer_type) or {}
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind != "default":
        raise UnsupportedModel(f"rotary embeddings of type {kind!r} ({layer_type}) are not supported (only the "
                               "default, unscaled rotary embedding)")
    return float(params.get("rope_theta", hf.get(key) or default))


def _read(hf: dict) -> dict:
    if hf.get("auto_map"):
        raise UnsupportedModel(f"a Gemma3 config with custom code (auto_map: {sorted(hf['auto_map'].values())[:2]}) "
                               "is not supported: only transformers' Gemma3TextModel is served")
    if hf.get("use_bidirectional_attention") is not True:
        raise UnsupportedModel(f"use_bidirectional_attention {hf.get('use_bidirectional_attention')!r} is not "
                               "supported (Gemma3 as EmbeddingGemma: bidirectional attention only)")
    act = hf.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise UnsupportedModel(f"hidden_activation {act!r} is not supported (Gemma3 with gelu_pytorch_tanh only)")
    if hf.get("attention_bias", False):
        raise UnsupportedModel("attention_bias true is not supported (Gemma3 without attention biases only)")
    if hf.get("attn_logit_softcapping") is not None:
        raise UnsupportedModel(f"attn_logit_softcapping {hf['attn_logit_softcapping']!r} is not supported (Gemma3 "
                               "without attention logit soft-capping only)")
    d = {**_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    count = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % d["sliding_window_pattern"] else
                                      "full_attention" for i in range(count)]
    if len(types) != count or set(types) - set(_LAYER_TYPES):
        raise UnsupportedModel(f"layer_types {types!r} are not supported ({count} of {', '.join(_LAYER_TYPES)})")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if sliding and ("sliding_window" in hf and hf["sliding_window"] is None or int(d["sliding_window"]) < 2):
        raise UnsupportedModel(f"sliding_window {hf.get('sliding_window')!r} is not supported with sliding-window "
                               "layers (at least 2)")
    window = int(d["sliding_window"]) // 2  # the keys at most this far away, either side (module docstring)
    heads = hf["num_attention_heads"]
    positions = d["max_position_embeddings"]
    return dict(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=count, num_heads=heads,
                num_kv_heads=d["num_key_value_heads"], head_size=d["head_dim"],
                intermediate_size=hf["intermediate_size"], type_vocab_size=1, layer_norm_eps=d["rms_norm_eps"],
                pad_token_id=hf.get("pad_token_id") or 0, max_position_embeddings=positions,
                max_seq_length=positions, rope_theta=_rope_theta(hf, "full_attention"),
                local_rope_theta=_rope_theta(hf, "sliding_attention"), sliding_layers=sliding,
                sliding_window=window if sliding else 0, hidden_act="gelu_pytorch_tanh", linear_bias=False,
                norm_bias=False, qk_norm=True,
                section=Gemma3Attention(float(d["query_pre_attn_scalar"])))


def gemma_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' Gemma3RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), in float32, rounded to x's dtype once."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).type_as(x)


class ScaledEmbeddings(nn.Module):
    """The token table times sqrt(hidden_size), the factor rounded to the table's dtype first (transformers'
    Gemma3TextScaledWordEmbedding: in bfloat16, sqrt(768) is 27.75)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        self.scale = config.hidden_size ** 0.5

    def forward(self, input_ids: Tensor, position_ids: Tensor | None, token_type_ids: Tensor | None) -> Tensor:
        x = F.embedding(input_ids, self.word_embeddings)
        return x * float(torch.tensor(self.scale).to(x.dtype))


class Layer(nn.Module):
    """Gemma3's decoder layer read both ways: Gemma's RMSNorm before and after each block, q/k norms, a tanh-GELU
    gate (gate rows first in ffn_in, then up rows)."""

    def __init__(self, config: EncoderConfig, index: int) -> None:
        super().__init__()
        h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
        self.num_heads, self.kv_heads, self.head_dim = config.num_heads, config.kv_heads, d
        self.eps = config.layer_norm_eps
        self.window = config.sliding_window if index in config.sliding_layers else 0
        scalar = config.section.query_pre_attn_scalar
        self.scaling = scalar ** -0.5
        self.q_scale = (d / scalar) ** 0.5  # rotary_attention scales by d^-0.5: q carries the rest
        self.in_ln_weight = nn.Parameter(torch.zeros(h))
        self.qkv = nn.Linear(h, (self.num_heads + 2 * self.kv_heads) * d, bias=False)
        self.q_ln_weight = nn.Parameter(torch.zeros(d))
        self.k_ln_weight = nn.Parameter(torch.zeros(d))
        self.attn_out = nn.Linear(self.num_heads * d, h, bias=False)
        self.post_attn_ln_weight = nn.Parameter(torch.zeros(h))
        self.pre_ffn_ln_weight = nn.Parameter(torch.zeros(h))
        self.ffn_in = nn.Linear(h, 2 * i, bias=False)  # gate rows, then up rows
        self.ffn_out = nn.Linear(i, h, bias=False)
        self.post_ffn_ln_weight = nn.Parameter(torch.zeros(h))

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """[N, hidden] -> q [N, heads, d] and k, v [N, kv_heads, d], q and k normed per head."""
        qkv = F.linear(gemma_rms_norm(x, self.in_ln_weight, self.eps), self.qkv.weight).view(x.shape[0], -1,
                                                                                             self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.kv_heads, self.kv_heads], dim=1)
        return gemma_rms_norm(q, self.q_ln_weight, self.eps), gemma_rms_norm(k, self.k_ln_weight, self.eps), v

    def _rest(self, x: Tensor, ctx: Tensor) -> Tensor:
        """The attention output's projection and norm joined to the stream, then the feed-forward block."""
        x = x + gemma_rms_norm(F.linear(ctx, self.attn_out.weight), self.post_attn_ln_weight, self.eps)
        gate, up = F.linear(gemma_rms_norm(x, self.pre_ffn_ln_weight, self.eps), self.ffn_in.weight).chunk(2, -1)
        h = F.linear(F.gelu(gate, approximate="tanh") * up, self.ffn_out.weight)
        return x + gemma_rms_norm(h, self.post_ffn_ln_weight, self.eps)

    def forward(self, x: Tensor, batch: int, seq: int, attn_mask: Tensor, inv_freq: Tensor) -> Tensor:
        # the padded layout in plain torch (a test oracle, independent of the kernel ops): x [batch * seq, hidden]
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in self._qkv(x))
        positions = torch.arange(seq, device=x.device)
        q, k = reference.rotate_half(q, positions, inv_freq), reference.rotate_half(k, positions, inv_freq)
        group = self.num_heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.scaling)
        return self._rest(x, ctx.transpose(1, 2).reshape(batch * seq, -1))

    def forward_packed(self, x: Tensor, p: Packed, inv_freq: Tensor) -> Tensor:
        q, k, v = self._qkv(x)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
        ctx = kernels.rotary_attention(qkv, p.cu_seqlens, p.seq, self.num_heads, inv_freq, self.window,
                                       self.kv_heads, False)
        return self._rest(x, ctx)


class Encoder(layers.RotaryEncoder):
    """The scaled token table, Layers, Gemma's final RMSNorm; global layers rotate by inv_freq (rope_theta), sliding
    ones by local_inv_freq (rope_local_base_freq), both kept float32. A float16 encoder is refused (module
    docstring): at load, and whenever the parameters change dtype (.to(), .half())."""

    FLOAT32_BUFFERS = ("inv_freq", "local_inv_freq")

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__(config, ScaledEmbeddings(config), (Layer(config, i) for i in range(config.num_layers)))
        self.final_ln_weight = nn.Parameter(torch.zeros(config.hidden_size))
        self.register_buffer("local_inv_freq", layers.inverse_frequencies(config.local_rope_theta, config.head_dim),
                             persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        super().reset_parameters(seed)
        for name, p in self.named_parameters():
            if name.endswith("ln_weight"):
                p.zero_()  # Gemma's norms scale by 1 + w: zero is the identity

    def _apply(self, fn, recurse=True):
        # the load refuses a float16 DTYPE before the weights load (Family.dtypes); this holds the module itself to it
        module = super()._apply(fn, recurse)
        GEMMA3.check_dtype(self.final_ln_weight.dtype)
        return module

    def frequencies(self, layer: Layer) -> Tensor:
        return self.local_inv_freq if layer.window else self.inv_freq

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        batch, seq = input_ids.shape
        x = self.embeddings(input_ids.reshape(-1), None, None)
        positions = torch.arange(seq, device=input_ids.device)
        # a padding query still sees itself (no empty softmax row); its output is never read
        itself = (positions[None, :] == positions[:, None])[None, None]
        keep = attention_mask.bool()[:, None, None, :] | itself
        near = keep & ((positions[None, :] - positions[:, None]).abs() <= self.config.sliding_window)[None, None]
        for layer in self.layers:
            x = layer(x, batch, seq, near if layer.window else keep, self.frequencies(layer))
        return gemma_rms_norm(x, self.final_ln_weight, self.config.layer_norm_eps).view(batch, seq, -1)

    def layer_steps(self, x: Tensor, p: Packed, attention: str) -> Iterator[Tensor]:
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer.forward_packed(x, p, self.frequencies(layer))
            yield gemma_rms_norm(x, self.final_ln_weight, self.config.layer_norm_eps) if i == last else x


def kernel_ops(layout: str, attention: str, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    """The kernels.* ops the packed forward calls (the padded layout is plain torch), mean pooling's included."""
    return ("rotary_attention", "segment_mean") if layout == "packed" else ()


# transformers' Gemma3TextModel names -> Layer's and Encoder's
WEIGHTS = WeightLayout(
    {"embed_tokens.weight": "embeddings.word_embeddings", "norm.weight": "final_ln_weight"},
    "layers.",
    {
        "input_layernorm.weight": "in_ln_weight",
        "self_attn.q_norm.weight": "q_ln_weight",
        "self_attn.k_norm.weight": "k_ln_weight",
        "self_attn.o_proj.weight": "attn_out.weight",
        "post_attention_layernorm.weight": "post_attn_ln_weight",
        "pre_feedforward_layernorm.weight": "pre_ffn_ln_weight",
        "mlp.down_proj.weight": "ffn_out.weight",
        "post_feedforward_layernorm.weight": "post_ffn_ln_weight",
    },
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    stacked={"ffn_in.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")},
    token_types=False,
)

GEMMA3 = Family("gemma3", ("gemma3_text",), "EmbeddingGemma (Gemma3)", _read, WEIGHTS, None, encoder=Encoder,
                kernel_ops=kernel_ops, attention="bidirectional grouped-query, global and sliding-window",
                positions="rotary, a base per layer type", few_token_layer=False, gated_ffn=True,
                dtype_on_cuda=torch.bfloat16, dtypes=(torch.float32, torch.bfloat16),
                dtypes_why="its model card's: its activations outgrow float16's range")
FAMILIES = (GEMMA3,)
