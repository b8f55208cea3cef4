"""The Llama and Mistral families as embedders (transformers' LlamaModel / MistralModel: e5-mistral-7b-instruct,
Linq-Embed-Mistral, SFR-Embedding-Mistral, and the Llama-based embedders served the way their config declares): the
decoder embedders' layers (model/layers.py's DecoderEncoder, Qwen's too) without biases or q/k norms, on the same fused
ops: kernels.rms_norm, kernels.rotary_attention (causal, grouped-query heads), kernels.add_rms_norm with the next
block's weights, kernels.linear_glu (SwiGLU in the GEMM's epilogue).

    x = embed[ids]
    x = x + Wo(attention(rotary(q), rotary(k), v))    q, k, v = Wqkv(RMS_in(x)), causal, GQA
    x = x + Wdown(silu(x Wgate^T) * (x Wup^T))        of RMS_post(x)
    hidden = RMS_final(x)

The sentence embedding is the last token's hidden state (sentence-transformers' `lasttoken` pooling): the EOS that
tokenizer_config.json's add_eos_token appends (model/tokenizer.py), after the instruction prompt
(config_sentence_transformers.json's prompts) and the text.

Mistral attends through a sliding window (config.json's `sliding_window`, 4096 where it says nothing as transformers'
MistralConfig, null for none): a query sees the `sliding_window` keys up to itself. An input no longer than the window
sees every key before it, so a window at least the served max_seq_length is causal attention and is served; a shorter
one would need windowed attention and is refused by name, at load and when max_seq_length is set afterwards. Scaled
rotary embeddings (Llama 3's `llama3`, linear, dynamic, YaRN), biases (attention_bias, mlp_bias), another activation,
attention that is not causal and custom code (`auto_map`: LLM2Vec's and NV-Embed's attend both ways) are refused by
name."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedserve.model import layers
from fusedserve.model.config import EncoderConfig, UnsupportedModel
from fusedserve.model.family import Family

MISTRAL_WINDOW = 4096  # transformers' MistralConfig's sliding_window where config.json has none


@dataclass(frozen=True)
class SlidingWindow:
    """Mistral's sliding window (EncoderConfig.section): a query attends to the `size` keys up to itself."""

    size: int


def _read(hf: dict, *, mistral: bool) -> dict:
    label = "Mistral" if mistral else "Llama"
    if hf.get("auto_map"):
        raise UnsupportedModel(f"a {label} config with custom code (auto_map: {sorted(hf['auto_map'].values())[:2]}) "
                               "is not supported: its code may change the attention (LLM2Vec's and NV-Embed's attend "
                               f"both ways), and only transformers' {label}Model is served")
    if hf.get("is_causal", True) is not True:
        raise UnsupportedModel(f"is_causal {hf['is_causal']!r} is not supported ({label} with causal attention only)")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"hidden_act {act!r} is not supported ({label} with a SiLU gate only)")
    for bias in ("attention_bias", "mlp_bias"):
        if hf.get(bias, False):
            raise UnsupportedModel(f"{bias} true is not supported ({label} without biases only)")
    rope = layers.default_rope(hf)  # refuses rope_scaling / a rope_type other than the default by its type
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    positions = hf.get("max_position_embeddings", 131_072 if mistral else 2048)  # their configs' defaults
    window = hf.get("sliding_window", MISTRAL_WINDOW) if mistral else None  # LlamaModel has no window
    return dict(vocab_size=hf["vocab_size"], hidden_size=hidden, num_layers=hf["num_hidden_layers"], num_heads=heads,
                num_kv_heads=hf.get("num_key_value_heads") or heads, head_size=hf.get("head_dim") or hidden // heads,
                intermediate_size=hf["intermediate_size"], type_vocab_size=1,
                layer_norm_eps=hf.get("rms_norm_eps", 1e-6),
                pad_token_id=hf.get("pad_token_id") or 0, max_position_embeddings=positions, max_seq_length=positions,
                rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0))), hidden_act="silu",
                linear_bias=False, norm_bias=False, qkv_bias=False, qk_norm=False,
                section=SlidingWindow(int(window)) if window else None)


def check_window(config: EncoderConfig) -> None:
    """Refuses a served max_seq_length longer than Mistral's sliding window: past the window an input's attention
    would be windowed, which this family does not serve (under it, the window hides no key)."""
    window = config.section
    if isinstance(window, SlidingWindow) and config.max_seq_length > window.size:
        raise UnsupportedModel(
            f"sliding_window {window.size} is shorter than max_seq_length {config.max_seq_length}: an input longer "
            "than the window would attend through it, and sliding-window attention is not served; serve a "
            f"max_seq_length of at most {window.size} (sentence_bert_config.json's)")


class Encoder(layers.DecoderEncoder):
    """The decoder stack, its config checked against Mistral's sliding window (check_window) whenever it is set:
    at construction and when the loader sets the served max_seq_length on it afterwards."""

    @property
    def config(self) -> EncoderConfig:
        return self._config

    @config.setter
    def config(self, config: EncoderConfig) -> None:
        check_window(config)
        self._config = config


_COMMON = dict(encoder=Encoder, kernel_ops=layers.decoder_kernel_ops, pooling=("lasttoken",),
               attention="causal grouped-query", positions="rotary", few_token_layer=False, gated_ffn=True,
               dtype_on_cuda=torch.bfloat16)
LLAMA = Family("llama", ("llama",), "Llama", lambda hf: _read(hf, mistral=False), layers.DECODER_WEIGHTS, None,
               **_COMMON)
MISTRAL = Family("mistral", ("mistral",), "Mistral", lambda hf: _read(hf, mistral=True), layers.DECODER_WEIGHTS, None,
                 **_COMMON)
FAMILIES = (LLAMA, MISTRAL)
