"""The table of architecture families and what reads a model directory's config through it. A new family is one
file declaring its `Family` (model/family.py) and one entry in FAMILIES."""

from __future__ import annotations

import json
from pathlib import Path

from fusedserve.model import bert, deberta_v2, gemma3, gte, llama, modernbert, mpnet, nomic_bert, qwen3
from fusedserve.model.config import EncoderConfig, UnsupportedModel
from fusedserve.model.family import Family

FAMILIES: tuple[Family, ...] = (bert.FAMILIES + mpnet.FAMILIES + gte.FAMILIES + nomic_bert.FAMILIES
                                 + modernbert.FAMILIES + qwen3.FAMILIES + deberta_v2.FAMILIES
                                 + llama.FAMILIES + gemma3.FAMILIES)
_BY_NAME = {f.name: f for f in FAMILIES}
_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}
SUPPORTED = ", ".join(_BY_MODEL_TYPE)  # config.json model_type values


def family(config: EncoderConfig) -> Family:
    """The family of a config (EncoderConfig.architecture)."""
    try:
        return _BY_NAME[config.architecture]
    except KeyError:
        raise UnsupportedModel(f"architecture {config.architecture!r}; supported: "
                               f"{', '.join(_BY_NAME)}") from None


def config_from_hf(hf: dict, **overrides) -> EncoderConfig:
    """An EncoderConfig from a transformers config.json dict, read by the family its model_type names."""
    # a config.json from before transformers wrote model_type is a BERT's
    model_type = hf.get("model_type", bert.BERT.model_types[0])
    found = _BY_MODEL_TYPE.get(model_type)
    if found is None:
        named = ", ".join(hf.get("architectures") or []) or "unnamed"
        raise UnsupportedModel(f"model_type {model_type!r} ({named}) is not supported; supported model types: "
                               f"{SUPPORTED}")
    return EncoderConfig(architecture=found.name, **{**found.read_config(hf), **overrides})


def config_from_dir(path: str | Path) -> EncoderConfig:
    """From a sentence-transformers / HF model directory (config.json [+ sentence_bert_config.json])."""
    path = Path(path)
    base = config_from_hf(json.loads((path / "config.json").read_text()))
    # sentence-transformers' and CrossEncoder's truncation: sentence_bert_config.json's max_seq_length, else the
    # tokenizer's model_max_length where it is shorter than the positions
    st_config, tokenizer_config = path / "sentence_bert_config.json", path / "tokenizer_config.json"
    max_seq = json.loads(st_config.read_text()).get("max_seq_length") if st_config.is_file() else None
    if not max_seq and tokenizer_config.is_file():
        limit = json.loads(tokenizer_config.read_text()).get("model_max_length")
        max_seq = limit if isinstance(limit, int) and limit < 1_000_000 else None
    overrides = {"normalize": _has_normalize_module(path)}
    if max_seq:
        overrides["max_seq_length"] = min(int(max_seq), base.max_seq_length)
    return base.replace(**overrides)


def _has_normalize_module(path: Path) -> bool:
    modules = path / "modules.json"
    if not modules.is_file():
        return True
    return any(m.get("type", "").endswith(".Normalize") for m in json.loads(modules.read_text()))
