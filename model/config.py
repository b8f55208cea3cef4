"""Encoder hyper-parameters: a frozen config with named presets, or one read from an HF config.json."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EncoderConfig:
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

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if not 0 < self.max_seq_length <= self.max_position_embeddings:
            raise ValueError(f"max_seq_length {self.max_seq_length} must be in 1..{self.max_position_embeddings}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_name(cls, name: str) -> EncoderConfig:
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown encoder preset {name!r}; presets: {', '.join(PRESETS)}") from None

    @classmethod
    def from_hf(cls, config: dict, **overrides) -> EncoderConfig:
        """From a transformers BertConfig dict (config.json)."""
        if config.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (only exact GELU, 'gelu')")
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are supported")
        values = dict(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            intermediate_size=config["intermediate_size"],
            max_position_embeddings=config["max_position_embeddings"],
            type_vocab_size=config.get("type_vocab_size", 2),
            layer_norm_eps=config.get("layer_norm_eps", 1e-12),
            pad_token_id=config.get("pad_token_id", 0),
            max_seq_length=config["max_position_embeddings"],
        )
        values.update(overrides)
        return cls(**values)

    @classmethod
    def from_dir(cls, path: str | Path) -> EncoderConfig:
        """From a sentence-transformers / HF model directory (config.json [+ sentence_bert_config.json])."""
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        overrides = {}
        st_config = path / "sentence_bert_config.json"
        if st_config.is_file():
            max_seq = json.loads(st_config.read_text()).get("max_seq_length")
            if max_seq:
                overrides["max_seq_length"] = min(int(max_seq), config["max_position_embeddings"])
        overrides["normalize"] = _has_normalize_module(path)
        return cls.from_hf(config, **overrides)

    def replace(self, **changes) -> EncoderConfig:
        return dataclasses.replace(self, **changes)


def _has_normalize_module(path: Path) -> bool:
    modules = path / "modules.json"
    if not modules.is_file():
        return True
    return any(m.get("type", "").endswith(".Normalize") for m in json.loads(modules.read_text()))


PRESETS: dict[str, EncoderConfig] = {
    # Random init, for fast tests (full vocabulary, so the real tokenizer can feed it).
    "tiny": EncoderConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=256,
                          max_position_embeddings=128, max_seq_length=128),
    # all-MiniLM-L6-v2's shape (the packaged weights are loaded by model.weights).
    "minilm-l6": EncoderConfig(max_seq_length=256),
    # BERT-base shape, random init, for benchmarks.
    "bert-base": EncoderConfig(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072),
}
