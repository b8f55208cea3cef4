"""Encoder hyper-parameters: a frozen config with named presets, or one read from an HF config.json. The served
architectures are the post-LN BERT family: BERT, RoBERTa / XLM-RoBERTa (positions offset past the padding index, one
token type) and DistilBERT (no token types, its own weight names); any other is refused naming what is supported."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


ARCHITECTURES = ("bert", "roberta", "distilbert")
# config.json model_type -> our architecture (XLM-RoBERTa is RoBERTa with another vocabulary)
MODEL_TYPES = {"bert": "bert", "roberta": "roberta", "xlm-roberta": "roberta", "distilbert": "distilbert"}
SUPPORTED = "BERT, RoBERTa, XLM-RoBERTa and DistilBERT encoders"


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

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if not 0 < self.max_seq_length <= self.max_position_embeddings - self.position_offset:
            raise ValueError(f"max_seq_length {self.max_seq_length} must be in "
                             f"1..{self.max_position_embeddings - self.position_offset}")
        if self.architecture not in ARCHITECTURES:
            raise UnsupportedModel(f"architecture {self.architecture!r}; supported: {SUPPORTED}")

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
        """From a transformers config.json dict (BertConfig, RobertaConfig, XLMRobertaConfig, DistilBertConfig)."""
        model_type = config.get("model_type", "bert")
        architecture = MODEL_TYPES.get(model_type)
        if architecture is None:
            named = ", ".join(config.get("architectures") or []) or "unnamed"
            raise UnsupportedModel(f"model_type {model_type!r} ({named}) is not supported; supported: {SUPPORTED}")
        if architecture == "distilbert":
            act, values = config.get("activation", "gelu"), dict(
                hidden_size=config["dim"], num_layers=config["n_layers"], num_heads=config["n_heads"],
                intermediate_size=config["hidden_dim"], type_vocab_size=1, layer_norm_eps=1e-12)
            if config.get("sinusoidal_pos_embds"):
                raise UnsupportedModel("DistilBERT with sinusoidal position embeddings is not supported")
        else:
            act, values = config.get("hidden_act", "gelu"), dict(
                hidden_size=config["hidden_size"], num_layers=config["num_hidden_layers"],
                num_heads=config["num_attention_heads"], intermediate_size=config["intermediate_size"],
                type_vocab_size=config.get("type_vocab_size", 2), layer_norm_eps=config.get("layer_norm_eps", 1e-12))
            if config.get("position_embedding_type", "absolute") != "absolute":
                raise UnsupportedModel(f"position_embedding_type {config['position_embedding_type']!r} is not "
                                       "supported (only absolute position embeddings)")
        if act != "gelu":
            key = "activation" if architecture == "distilbert" else "hidden_act"
            raise UnsupportedModel(f"{key} {act!r} is not supported (only exact GELU, 'gelu')")
        pad = config.get("pad_token_id", 0) if config.get("pad_token_id") is not None else 0
        offset = pad + 1 if architecture == "roberta" else 0
        values.update(architecture=architecture, vocab_size=config["vocab_size"],
                      max_position_embeddings=config["max_position_embeddings"], pad_token_id=pad,
                      position_offset=offset, max_seq_length=config["max_position_embeddings"] - offset)
        values.update(overrides)
        return cls(**values)

    @classmethod
    def from_dir(cls, path: str | Path) -> EncoderConfig:
        """From a sentence-transformers / HF model directory (config.json [+ sentence_bert_config.json])."""
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        overrides = {}
        st_config = path / "sentence_bert_config.json"
        base = cls.from_hf(config)
        # sentence-transformers' and CrossEncoder's truncation: sentence_bert_config.json's max_seq_length, else the
        # tokenizer's model_max_length where it is shorter than the positions
        max_seq = json.loads(st_config.read_text()).get("max_seq_length") if st_config.is_file() else None
        tokenizer_config = path / "tokenizer_config.json"
        if not max_seq and tokenizer_config.is_file():
            limit = json.loads(tokenizer_config.read_text()).get("model_max_length")
            max_seq = limit if isinstance(limit, int) and limit < 1_000_000 else None
        if max_seq:
            overrides["max_seq_length"] = min(int(max_seq), base.max_seq_length)
        overrides["normalize"] = _has_normalize_module(path)
        return base.replace(**overrides)

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
    # XLM-RoBERTa-base's shape (multilingual-e5-base, bge-m3's smaller sibling), random init, for benchmarks.
    "xlm-roberta-base": EncoderConfig(architecture="roberta", vocab_size=250002, hidden_size=768, num_layers=12,
                                      num_heads=12, intermediate_size=3072, max_position_embeddings=514,
                                      type_vocab_size=1, layer_norm_eps=1e-5, pad_token_id=1, position_offset=2,
                                      max_seq_length=512),
}
