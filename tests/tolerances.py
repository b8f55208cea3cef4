"""The embedding tolerance table, beside the kernel one.

kernels.testing.TOLERANCES bounds one op's output against its float64 reference (the registry's start-up self-test and
the kernel tests use it). EMBEDDING_TOLERANCES bounds a whole model's embeddings against a float32 reference embedding
of the same input: sentence-transformers, the torch reference path, or the same input run alone, in another batch,
in another layout, eagerly instead of from a CUDA graph. Per dtype of the model under test: the smallest cosine
similarity of any row, and the largest elementwise absolute difference (on unit-length embeddings, or the tiny
test models' raw pooled vectors, of the same order).

Every model, server, load and GPU test compares embeddings through assert_embeddings_close (or reads the table);
a test that checks something else on purpose (bitwise equality, a fault that must change the output) says so where
it does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class EmbeddingTolerance:
    min_cosine: float  # every row's cosine similarity with its reference row is at least this
    max_abs: float  # and no element differs from the reference by more than this


# Cosine: float32 is the same math in another order (accumulation order, another batch, layout or attention path); the
# packaged MiniLM is far closer than this to sentence-transformers. float16 / bfloat16 are the model run in that dtype
# against an fp32 reference, set from the dtype's rounding (fp16 keeps 10 mantissa bits, bf16 7) with headroom over
# what the GPU tests and the CPU bf16 test measure (docs/performance.md). Max abs: the kernel table's elementwise atol
# for the dtype, one op's bound, which a whole forward stays within on embeddings of unit length.
EMBEDDING_TOLERANCES: dict[torch.dtype, EmbeddingTolerance] = {
    torch.float32: EmbeddingTolerance(min_cosine=0.99999, max_abs=1e-5),
    torch.float16: EmbeddingTolerance(min_cosine=0.9999, max_abs=2e-3),
    torch.bfloat16: EmbeddingTolerance(min_cosine=0.999, max_abs=1.6e-2),
}


def tolerance(dtype: torch.dtype | str = torch.float32) -> EmbeddingTolerance:
    """The table's entry for a dtype, given as a torch.dtype or its name ("float16")."""
    return EMBEDDING_TOLERANCES[getattr(torch, dtype) if isinstance(dtype, str) else dtype]


def _float64(x) -> torch.Tensor:
    if torch.is_tensor(x):
        return x.detach().to("cpu", torch.float64)
    return torch.from_numpy(np.array(x, dtype=np.float64))  # a copy: JSON lists, read-only buffers


def embedding_errors(got, want) -> tuple[float, float]:
    """(min cosine over rows, max abs difference) of two [rows, dim] (or [dim]) embeddings: tensors, arrays, lists."""
    a, b = _float64(got), _float64(want)
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    if a.numel() == 0:
        return 1.0, 0.0
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=1)
    return float(cosine.min()), float((a - b).abs().max())


def assert_embeddings_close(got, want, dtype: torch.dtype | str = torch.float32, what: str = "") -> tuple[float, float]:
    """Fail unless `got` is within the table's entry for `dtype` of `want`; returns (min cosine, max abs)."""
    tol = tolerance(dtype)
    cosine, max_abs = embedding_errors(got, want)
    assert cosine >= tol.min_cosine and max_abs <= tol.max_abs, (
        f"{what + ': ' if what else ''}min cosine {cosine:.7f} (at least {tol.min_cosine}), "
        f"max abs {max_abs:.2e} (at most {tol.max_abs:.0e}) in {dtype}")
    return cosine, max_abs


def assert_unit_length(vectors, dtype: torch.dtype | str = torch.float32) -> None:
    """Normalized embeddings: every row's length is 1 within the table's max abs."""
    v = _float64(vectors)
    error = float((v.reshape(-1, v.shape[-1]).norm(dim=1) - 1).abs().max())
    assert error <= tolerance(dtype).max_abs, f"a row's length differs from 1 by {error:.2e}"
