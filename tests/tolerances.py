"""The embedding and score tolerance tables, beside the kernel one.

kernels.testing.TOLERANCES bounds one op's output against its float64 reference (the registry's start-up self-test and
the kernel tests use it). EMBEDDING_TOLERANCES bounds a whole model's embeddings against a float32 reference embedding
of the same input: sentence-transformers, the torch reference path, or the same input run alone, in another batch,
in another layout, eagerly instead of from a CUDA graph. Per dtype of the model under test: the smallest cosine
similarity of any row, and the largest elementwise absolute difference (on unit-length embeddings, or the tiny
test models' raw pooled vectors, of the same order).

SCORE_TOLERANCES bounds a classifier's scores (and cosine similarities) the same way: per dtype of the model under
test, the largest absolute difference from a float32 reference score (raw logits: relative to their size).
assert_same_rows is the exact case: the same request's rows as another route or wire format carries them.
QUANTIZED_TOLERANCE bounds int8 / uint8 embeddings quantized from two float32 sides within the table of each other,
and FP8_QUANTIZATION one FP8 quantizing kernel against the GPU's own conversion.

Every model, server, load and GPU test compares embeddings through assert_embeddings_close or assert_same_rows and
scores through assert_scores_close (or reads the tables); a test that checks something else on purpose (bitwise
equality, a fault that must change the output) says so where it does.
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
    # PRECISION=fp8: the four GEMMs of each layer on E4M3 operands (3 mantissa bits, ~4% per element) and the rest in
    # the dtype, against an fp32 reference: set from the real MiniLM (the CPU test and the GPU test measure it; the
    # per-text distribution is bench encoder fp8-accuracy's), not from the rounding of one op
    torch.float8_e4m3fn: EmbeddingTolerance(min_cosine=0.985, max_abs=4e-2),
}


# Scores: a classifier's sigmoid or softmax outputs (in [0, 1]) and cosine similarities, in absolute terms. Raw logits
# are not bounded like scores, so they get the same bound relative to their size (at least 1). float32 is the same
# math in another order; float16 / bfloat16 are the classifier run in that dtype on the fused kernels against an fp32
# reference (the bound the GPU classifier tests hold them to).
SCORE_TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float16: 1e-2,
    torch.bfloat16: 1e-2,
}


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def tolerance(dtype: torch.dtype | str = torch.float32) -> EmbeddingTolerance:
    """The table's entry for a dtype, given as a torch.dtype or its name ("float16")."""
    return EMBEDDING_TOLERANCES[_dtype(dtype)]


def score_tolerance(dtype: torch.dtype | str = torch.float32) -> float:
    """The largest absolute error of a score for a dtype, given as a torch.dtype or its name."""
    return SCORE_TOLERANCES[_dtype(dtype)]


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


def assert_scores_close(got, want, dtype: torch.dtype | str = torch.float32, *, logits: bool = False,
                        what: str = "") -> float:
    """Fail unless every score of `got` is within the score table's entry for `dtype` of `want` (any shape: tensors,
    arrays, lists, one number); logits=True: raw logits, bounded relative to the reference's size (at least 1).
    Returns the largest absolute difference."""
    a, b = _float64(got), _float64(want)
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    difference = (a - b).abs()
    bound = score_tolerance(dtype) * (b.abs().clamp(min=1.0) if logits else torch.ones_like(b))
    worst = int((difference - bound).argmax()) if difference.numel() else 0
    assert bool((difference <= bound).all()), (
        f"{what + ': ' if what else ''}{'logit' if logits else 'score'} {a.flatten()[worst].item():.7g} differs from "
        f"{b.flatten()[worst].item():.7g} by {difference.flatten()[worst].item():.2e} (at most "
        f"{bound.flatten()[worst].item():.0e}) in {dtype}")
    return float(difference.max()) if difference.numel() else 0.0


# Quantized embeddings (int8 / uint8 against calibration ranges, server.quantize): the same rows quantized from two
# float32 sides within the float32 table of each other (another batch, another calibration batch) land on the same
# step, except a value within that bound of the edge between two steps, which lands on either: one step apart at most,
# and those values are few.
@dataclass(frozen=True)
class QuantizedTolerance:
    max_steps: int  # no value differs from the reference by more steps than this
    min_same_share: float  # and at least this share of the values are the same step


QUANTIZED_TOLERANCE = QuantizedTolerance(max_steps=1, min_same_share=0.99)


def assert_quantized_close(got, want, what: str = "") -> None:
    """Fail unless the quantized embeddings `got` and `want` (integer arrays or lists of one shape) are within
    QUANTIZED_TOLERANCE of each other."""
    a, b = np.asarray(got, dtype=np.int64), np.asarray(want, dtype=np.int64)
    assert a.shape == b.shape, (a.shape, b.shape)
    steps, same = int(np.abs(a - b).max(initial=0)), float((a == b).mean()) if a.size else 1.0
    tol = QUANTIZED_TOLERANCE
    assert steps <= tol.max_steps and same >= tol.min_same_share, (
        f"{what + ': ' if what else ''}{steps} steps apart at most (at most {tol.max_steps}), {same:.2%} the same "
        f"(at least {tol.min_same_share:.0%})")


# One FP8 quantizing kernel (kernels.fp8) against the GPU's own conversion of the same values. The rounding error in
# units of the bound E4M3 allows (kernels.fp8.quantization_error) is at most 1.0 for a correct rounding and a little
# over where the kernel's fp32 x / scale sits within an ulp of a tie (the registry's self-test holds the kernels to the
# same bound); those near-ties are the only values the kernel may round the other way from the device.
@dataclass(frozen=True)
class Fp8QuantizationTolerance:
    max_rounding_error: float  # kernels.fp8.quantization_error, in units of E4M3's rounding bound
    min_same_as_device: float  # the share of values equal to the device's own conversion


FP8_QUANTIZATION = Fp8QuantizationTolerance(max_rounding_error=1.01, min_same_as_device=0.999)


# Sparse (SPLADE) vectors: each value is log(1 + relu(logit)) of a masked-LM logit, a raw score of the model, so it
# gets the score table's bound relative to its size (at least 1). Which entries are non-zero must agree wherever
# either side's value exceeds SPARSE_SUPPORT plus that bound: a logit within the bound of zero may fall either side.
SPARSE_SUPPORT = 1e-3


def assert_sparse_close(got, want, dtype: torch.dtype | str = torch.float32, what: str = "") -> None:
    """Fail unless the sparse vectors `got` and `want` (dense [rows, vocabulary]: tensors, arrays, lists) have the
    same non-zero entries above the support threshold and values within the score bound of each other."""
    a, b = _float64(got), _float64(want)
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    assert bool(torch.isfinite(a).all()), f"{what}: non-finite values"
    bound = score_tolerance(dtype) * b.abs().clamp(min=1.0)
    assert_scores_close(a, b, dtype, logits=True, what=what or "sparse values")
    either = (a > SPARSE_SUPPORT + bound) | (b > SPARSE_SUPPORT + bound)
    lost = either & ((a <= 0) | (b <= 0))
    assert not bool(lost.any()), (f"{what + ': ' if what else ''}{int(lost.sum())} entries non-zero on one side only, "
                                  f"e.g. {lost.nonzero()[:4].tolist()}")
    assert bool((b > SPARSE_SUPPORT).any()), f"{what}: the reference has no entry above {SPARSE_SUPPORT}: nothing tested"


# The same rows through another route or wire format, exactly. One server answers a repeated request with the same
# rows (the same inputs form the same batch, which runs the same kernels), and a float32 crosses every float encoding
# unchanged: JSON carries the shortest decimal that reads back as that float32, base64 and KServe's binary tensor data
# carry its bytes. A comparison whose two sides batch the inputs differently (one input alone against it in a batch,
# another model run) goes through assert_embeddings_close instead.
def assert_same_rows(got, want, what: str = "") -> None:
    """Fail unless `got` and `want` ([rows, dim] or [dim]: tensors, arrays, lists) are the same float32 values."""
    a = _float64(got).to(torch.float32)
    b = _float64(want).to(torch.float32)
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    if not torch.equal(a, b):
        differs = (a != b).nonzero()
        first = tuple(differs[0].tolist())
        raise AssertionError(f"{what + ': ' if what else ''}{len(differs)} of {a.numel()} values differ, the first at "
                             f"{first}: {a[first].item():.9g} against {b[first].item():.9g}")
