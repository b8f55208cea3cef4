"""A BERT-architecture sentence encoder built on `kernels.*` ops (plus matmuls and torch SDPA)."""

from model.config import EncoderConfig
from model.encoder import Encoder
from model.runner import Embedder

__all__ = ["EncoderConfig", "Encoder", "Embedder"]
