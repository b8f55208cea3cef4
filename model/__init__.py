"""A BERT-architecture sentence encoder built on `kernels.*` ops (plus matmuls and torch SDPA)."""

if __name__ != "fusedserve.model":  # one module, one name in a process (docs/decisions/0015)
    raise ImportError(f"this package is fusedserve.model: import it by that name, not as {__name__!r}")

from fusedserve.model.config import EncoderConfig
from fusedserve.model.encoder import Encoder
from fusedserve.model.runner import Embedder

__all__ = ["EncoderConfig", "Encoder", "Embedder"]
