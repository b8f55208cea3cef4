"""Output types of an embedding, chosen per request: `float`, `base64` (the float32 bytes, little-endian), and the
quantized `int8`, `uint8`, `binary`, `ubinary` with sentence-transformers' `quantize_embeddings` semantics.

- `int8` / `uint8`: per dimension, the range [min, max] of the calibration embeddings is cut into 255 steps;
  a value becomes floor((v - min) / step) clipped to [0, 255] (uint8), minus 128 for int8. Values outside the
  calibration range clip. The calibration embeddings are CALIBRATION_TEXTS' embeddings shaped as the request asks
  for its own (normalized or not, the first `dimensions` renormalized); a server computes them once (at warm-up, or
  at the first quantized request), and `/info` shows the ranges of normalized full-width embeddings, so clients
  can quantize stored vectors the same way.
- `binary` / `ubinary`: one bit per dimension (1 where the value is > 0), packed 8 to a byte, most significant bit
  first (numpy.packbits); `ubinary` is the bytes as uint8, `binary` the same minus 128 as int8. A width that is not
  a multiple of 8 is padded with 0 bits.
"""

from __future__ import annotations

import base64
from typing import NamedTuple

import numpy as np

from fusedserve.model.api import l2_normalize

ENCODINGS = ("float", "base64", "int8", "uint8", "binary", "ubinary")
QUANTIZED = ("int8", "uint8")

# Varied topics, lengths and languages: the per-dimension ranges should cover what clients send. Fixed, so every
# replica of a model quantizes alike and stored int8 vectors stay comparable across restarts.
CALIBRATION_TEXTS = (
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "How do I reset my password?",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "The mitochondria is the powerhouse of the cell.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "The stock market fell sharply after the central bank raised interest rates.",
    "Quarterly revenue grew by twelve percent compared with the same period last year.",
    "Preheat the oven to 200 degrees and bake the bread for forty minutes.",
    "Add two cups of flour, a pinch of salt and stir until smooth.",
    "The patient reported chest pain and shortness of breath.",
    "Take one tablet twice a day with food.",
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "SELECT name, email FROM users WHERE created_at > '2020-01-01' ORDER BY name;",
    "The function raises a ValueError when the input is empty.",
    "Kubernetes restarts a container whose liveness probe fails.",
    "GPU kernels fuse several operations to avoid round trips through memory.",
    "The quick brown fox jumps over the lazy dog.",
    "It was the best of times, it was the worst of times.",
    "To be, or not to be, that is the question.",
    "The referee showed a red card in the final minute of the match.",
    "The team won the championship after a penalty shootout.",
    "Heavy rain is expected across the region tomorrow afternoon.",
    "The temperature dropped below freezing overnight.",
    "Our flight was delayed by three hours because of fog.",
    "The hotel room had a beautiful view of the mountains.",
    "I love this phone, the battery lasts for days!",
    "Terrible service, I will never order from this shop again.",
    "The package arrived damaged and two items were missing.",
    "Thank you for your help, the issue is resolved now.",
    "Der Hund spielt im Garten mit einem Ball.",
    "Le chat dort sur le canapé depuis ce matin.",
    "El tren sale de la estación a las ocho en punto.",
    "Il museo è chiuso il lunedì.",
    "東京は日本の首都です。",
    "我喜欢在周末读书和散步。",
    "서울은 대한민국의 수도입니다.",
    "Москва — столица России.",
    "The court ruled that the contract was void.",
    "The tenant must give thirty days' notice before moving out.",
    "Elections will be held in November.",
    "The senator proposed a new bill on renewable energy.",
    "Black holes bend light with their enormous gravity.",
    "The spacecraft entered orbit around Mars.",
    "Vaccines train the immune system to recognise a pathogen.",
    "Regular exercise lowers the risk of heart disease.",
    "yes",
    "no",
    "hello world",
    "Error 404: page not found",
    "Meeting moved to 3pm, room B.",
    "Please find the invoice attached.",
    "The painting uses bold colours and sharp geometric shapes.",
    "The orchestra performed the symphony without a conductor.",
    "Bees communicate the location of flowers by dancing.",
    "The river floods every spring when the snow melts.",
)


def ranges_of(calibration: np.ndarray) -> np.ndarray:
    """[2, dim] float32: per-dimension minimum and maximum of the calibration embeddings."""
    return np.stack([calibration.min(axis=0), calibration.max(axis=0)]).astype(np.float32)


def quantize(matrix: np.ndarray, encoding: str, ranges: np.ndarray | None = None) -> np.ndarray:
    """[n, dim] float32 -> [n, dim] int8/uint8, or [n, ceil(dim / 8)] packed bits (sentence-transformers'
    quantize_embeddings with explicit ranges)."""
    if encoding in QUANTIZED:
        if ranges is None:
            raise ValueError(f"{encoding} needs calibration ranges")
        starts = ranges[0]
        steps = (ranges[1] - starts) / 255
        steps = np.where(steps == 0, 1, steps)
        buckets = np.clip(np.floor((matrix - starts) / steps), 0, 255)
        return buckets.astype(np.uint8) if encoding == "uint8" else (buckets - 128).astype(np.int8)
    if encoding == "ubinary":
        return np.packbits(matrix > 0, axis=-1)
    if encoding == "binary":
        return (np.packbits(matrix > 0, axis=-1).astype(np.int16) - 128).astype(np.int8)
    raise ValueError(f"unknown quantized encoding {encoding!r}")


def encode(matrix: np.ndarray, encoding: str, ranges: np.ndarray | None = None):
    """What a response carries for the rows of `matrix` (orjson writes numpy arrays as nested lists): the float32
    matrix, one base64 string per row, or the quantized matrix."""
    if encoding == "float":
        return np.ascontiguousarray(matrix, dtype=np.float32)
    if encoding == "base64":
        rows = np.ascontiguousarray(matrix, dtype="<f4")
        return [base64.b64encode(row.tobytes()).decode() for row in rows]
    return quantize(matrix, encoding, ranges)


# Per-token (multi-vector) answers: `float` as nested lists (TEI's /embed_all), or per input one object {"shape":
# [tokens, dim], "dtype", "data": base64 of its little-endian row-major block}: float32, or float16 (half the bytes;
# ColBERT's MaxSim loses nothing it can rank on). The bytes an answer takes per value, for the response byte limit
# (JSON floats: about 11 characters and a separator each).
MULTI_VECTOR_ENCODINGS = {"float": ("float32", 12.0), "base64": ("float32", 16 / 3), "base64_float16": ("float16", 8 / 3)}


def encode_multi_vectors(blocks: list[np.ndarray], encoding: str) -> list:
    """Per input, its [tokens, dim] vectors as a response carries them (MULTI_VECTOR_ENCODINGS)."""
    if encoding == "float":
        return [np.ascontiguousarray(block, dtype=np.float32) for block in blocks]
    dtype = MULTI_VECTOR_ENCODINGS[encoding][0]
    little = np.dtype(dtype).newbyteorder("<")
    return [{"shape": list(block.shape), "dtype": dtype,
             "data": base64.b64encode(np.ascontiguousarray(block, dtype=little).tobytes()).decode()}
            for block in blocks]


def shape(rows: np.ndarray, *, normalize: bool, dimensions: int | None) -> np.ndarray:
    """Raw rows as a request asks for them: the first `dimensions` columns (Matryoshka), then L2-normalized when it
    asks for normalized embeddings: the one place embeddings are normalized on their way out (the batcher runs it once per batch and
    request shape, on its worker thread)."""
    if dimensions is not None and dimensions < rows.shape[1]:
        rows = rows[:, :dimensions]
    return l2_normalize(rows) if normalize else rows


class SparseRow(NamedTuple):
    """One input's sparse vector: its non-zero entries, `indices` (token ids, ascending, int64) and their `values`
    (float32)."""

    indices: np.ndarray
    values: np.ndarray


def sparse_of_rows(rows: np.ndarray) -> list[SparseRow]:
    """A SPLADE model's vocabulary-wide rows [n, vocabulary] as sparse rows: the entries above zero (its log(1 +
    relu) is zero everywhere else)."""
    out = []
    for row in rows:
        index = np.flatnonzero(row > 0)
        out.append(SparseRow(index, row[index]))
    return out


def sparse_of_tokens(weights: np.ndarray, ids: np.ndarray, lengths: np.ndarray) -> list[SparseRow]:
    """BGE-M3's sparse output as the model gives it (model.api.Output "sparse": per token of the batch, its weight
    where it holds its input's largest for its id, else zero; `ids` and `lengths` the batch's) as sparse rows."""
    out = []
    for w, i in zip(np.split(weights, np.cumsum(lengths)[:-1]), np.split(ids, np.cumsum(lengths)[:-1])):
        keep = np.flatnonzero(w > 0)
        order = np.argsort(i[keep], kind="stable")
        out.append(SparseRow(i[keep][order].astype(np.int64), w[keep][order]))
    return out


def sparse_entries(rows: list[SparseRow]) -> list[list[dict]]:
    """Sparse rows as text-embeddings-inference's /embed_sparse gives them: per row, its entries as {"index",
    "value"} in index order."""
    return [[{"index": int(i), "value": float(v)} for i, v in zip(row.indices, row.values)] for row in rows]
