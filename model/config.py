"""Encoder hyper-parameters: a frozen config with named presets. A model directory's config.json is read by its
architecture family (model/families.py); `architecture` names the family."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from dataclasses import dataclass


class UnsupportedModel(ValueError):
    """A checkpoint this server cannot run exactly (architecture, activation, pooling or module): never served
    approximately."""


@dataclass(frozen=True)
class EncoderConfig:
    architecture: str = "bert"
    vocab_size: int = 30522
    hidden_size: int = 384
    num_layers: int = 6
    num_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    # Longest input after truncation, special tokens included (sentence-transformers' max_seq_length).
    max_seq_length: int = 512
    normalize: bool = True  # L2-normalize pooled embeddings by default (sentence-transformers' Normalize module)
    # added to every token's position within its sequence (RoBERTa counts positions from padding_idx + 1)
    position_offset: int = 0
    # relative position bias buckets shared by all layers (MPNet's); 0: none
    relative_attention_buckets: int = 0
    # rotary position embeddings' base (GTE's, NomicBERT's, ModernBERT's global layers'); 0: none
    rope_theta: float = 0.0
    # the gated feed-forward's activation (GTE, ModernBERT: exact GELU; NomicBERT: SiLU)
    hidden_act: str = "gelu"
    # whether the layers' linear projections carry biases (ModernBERT's and NomicBERT's do not), and their LayerNorms
    # (ModernBERT's do not)
    linear_bias: bool = True
    norm_bias: bool = True
    # sliding-window attention (ModernBERT's local layers): in these layers a query attends to the keys at most
    # `sliding_window` positions away, with rotary base local_rope_theta
    sliding_layers: tuple[int, ...] = ()
    sliding_window: int = 0
    local_rope_theta: float = 0.0
    # decoder embedders (Qwen2 / Qwen3): grouped-query attention with num_kv_heads key/value heads (0: num_heads), a
    # head width of its own (0: hidden_size / num_heads), biases on the query/key/value projections alone (Qwen2's)
    # and each head's query and key RMS-normed before the rotation (Qwen3's q_norm / k_norm)
    num_kv_heads: int = 0
    head_size: int = 0
    qkv_bias: bool = False
    qk_norm: bool = False
    # what one family alone reads (DeBERTa's disentangled attention): a frozen dataclass its file declares and its
    # config reading fills, so that a new family's hyper-parameters stay in its room instead of growing this class;
    # None where the family has none
    section: Hashable | None = None

    def __post_init__(self) -> None:
        if not self.head_size and self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_kv_heads and self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if not 0 < self.max_seq_length <= self.max_position_embeddings - self.position_offset:
            raise ValueError(f"max_seq_length {self.max_seq_length} must be in "
                             f"1..{self.max_position_embeddings - self.position_offset}")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @classmethod
    def from_name(cls, name: str) -> EncoderConfig:
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown encoder preset {name!r}; presets: {', '.join(PRESETS)}") from None

    def replace(self, **changes) -> EncoderConfig:
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, EncoderConfig] = {
    # Random init, for fast tests (full vocabulary, so the real tokenizer can feed it).
    "tiny": EncoderConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=256,
                          max_position_embeddings=128, max_seq_length=128),
    # all-MiniLM-L6-v2's shape (the packaged weights are loaded by model.weights).
    "minilm-l6": EncoderConfig(max_seq_length=256),
    # BERT-base shape, random init, for benchmarks.
    "bert-base": EncoderConfig(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072),
    # XLM-RoBERTa-base's shape (multilingual-e5-base, bge-m3's smaller sibling), random init, for benchmarks.
    "xlm-roberta-base": EncoderConfig(architecture="roberta", vocab_size=250002, hidden_size=768, num_layers=12,
                                      num_heads=12, intermediate_size=3072, max_position_embeddings=514,
                                      type_vocab_size=1, layer_norm_eps=1e-5, pad_token_id=1, position_offset=2,
                                      max_seq_length=512),
    # all-mpnet-base-v2's shape, random init, for benchmarks.
    "mpnet-base": EncoderConfig(architecture="mpnet", vocab_size=30527, hidden_size=768, num_layers=12, num_heads=12,
                                intermediate_size=3072, max_position_embeddings=514, type_vocab_size=1,
                                layer_norm_eps=1e-5, pad_token_id=1, position_offset=2, max_seq_length=512,
                                relative_attention_buckets=32),
    # gte-multilingual-base's shape (rotary positions, gated GELU), random init, for benchmarks.
    "gte-base": EncoderConfig(architecture="gte", vocab_size=250048, hidden_size=768, num_layers=12, num_heads=12,
                              intermediate_size=3072, max_position_embeddings=8192, type_vocab_size=1,
                              layer_norm_eps=1e-12, pad_token_id=1, max_seq_length=8192, rope_theta=160000.0),
    # nomic-embed-text-v1.5's shape (rotary positions, SwiGLU, no biases), random init, for benchmarks.
    "nomic-bert-base": EncoderConfig(architecture="nomic_bert", vocab_size=30528, hidden_size=768, num_layers=12,
                                     num_heads=12, intermediate_size=3072, max_position_embeddings=8192,
                                     type_vocab_size=2, layer_norm_eps=1e-12, max_seq_length=8192, rope_theta=1000.0,
                                     hidden_act="silu", linear_bias=False),
    # ModernBERT-base's shape (pre-norm, GeGLU, a global layer every third, the rest sliding-window), random init,
    # for benchmarks.
    "modernbert-base": EncoderConfig(architecture="modernbert", vocab_size=50368, hidden_size=768, num_layers=22,
                                     num_heads=12, intermediate_size=1152, max_position_embeddings=8192,
                                     type_vocab_size=1, layer_norm_eps=1e-5, pad_token_id=50283, max_seq_length=8192,
                                     rope_theta=160000.0, linear_bias=False, norm_bias=False,
                                     sliding_layers=tuple(i for i in range(22) if i % 3), sliding_window=64,
                                     local_rope_theta=10000.0),
    # Qwen3-Embedding-0.6B's shape (a decoder: causal grouped-query attention, 16 query heads of 128 over 8 key/value
    # heads, q/k RMSNorm, SwiGLU), random init, for benchmarks.
    "qwen3-0.6b": EncoderConfig(architecture="qwen3", vocab_size=151669, hidden_size=1024, num_layers=28,
                                num_heads=16, intermediate_size=3072, max_position_embeddings=32768, type_vocab_size=1,
                                layer_norm_eps=1e-6, pad_token_id=151643, max_seq_length=32768, rope_theta=1_000_000.0,
                                hidden_act="silu", linear_bias=False, norm_bias=False, num_kv_heads=8, head_size=128,
                                qk_norm=True),
}
