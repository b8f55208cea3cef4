"""The peer scenario's parts that run without Infinity's wheels (CI has none): the transformers-5 shim Infinity is
launched with, on the real MiniLM tokenizer, the same-model check's cosine, and one measured point of the OpenAI
request against a real server."""

from __future__ import annotations

import argparse
import math
import random

import pytest
from transformers import AutoTokenizer

from bench import peer
from bench.harness import SAME_MODEL_MIN_COSINE, min_cosine, running_servers
from fusedserve.model.tokenizer import TextTokenizer
from fusedserve.model.weights import default_model_dir

TEXTS = ["a short sentence", "another one, a little longer than the first", "three " * 1200]


def test_the_shim_counts_tokens_as_infinity_asks_for_them():
    import bench.peer_launch  # noqa: F401  (patches the tokenizer base class on import, as in Infinity's process)

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    # Infinity 0.0.78's call (transformer/embedder/sentence_transformer.py, tokenize_lengths), word for word
    encodings = tokenizer.batch_encode_plus(TEXTS, add_special_tokens=False, return_token_type_ids=False,
                                            return_attention_mask=False, return_length=False,
                                            truncation="longest_first").encodings
    full = TextTokenizer(default_model_dir(), 256).untruncated.encode_batch(TEXTS, add_special_tokens=False)
    lengths = [len(e.tokens) for e in encodings]
    assert lengths[:2] == [len(e.ids) for e in full[:2]]
    assert lengths[2] == tokenizer.model_max_length < len(full[2].ids)  # cut to the model's length


def _cosines(a: list[list[float]], b: list[list[float]]) -> list[float]:
    """Row by row, in plain Python: the dot product over the product of the lengths."""
    return [sum(x * y for x, y in zip(u, v, strict=True)) /
            math.sqrt(sum(x * x for x in u) * sum(y * y for y in v)) for u, v in zip(a, b, strict=True)]


def test_min_cosine_is_the_lowest_row_cosine():
    rng = random.Random(0)
    a = [[rng.gauss(0, 1) for _ in range(48)] for _ in range(6)]
    near = [[x + rng.gauss(0, 0.01) for x in row] for row in a]  # the same rows, slightly perturbed
    far = [[rng.gauss(0, 1) for _ in range(48)] for _ in range(6)]  # unrelated rows
    for b in (near, far, [[3.0 * x for x in row] for row in a]):
        assert min_cosine(a, b) == pytest.approx(min(_cosines(a, b)), abs=1e-12)
    assert SAME_MODEL_MIN_COSINE < min_cosine(a, near) < 1 and min_cosine(a, far) < 0.5
    # one row that disagrees decides it: orthogonal, then opposite
    assert min_cosine([[1.0, 0.0], [1.0, 1.0]], [[1.0, 0.0], [1.0, -1.0]]) == pytest.approx(0.0, abs=1e-12)
    assert min_cosine(a, [row if i != 3 else [-x for x in row] for i, row in enumerate(a)]) == pytest.approx(-1.0)


def test_one_point_of_the_openai_request_against_a_real_server():
    tokens = [len(r) for r in TextTokenizer(default_model_dir(), 128).encode(TEXTS[:2])]
    args = argparse.Namespace(seconds=1.5, per_request=2, client_processes=1)
    with running_servers(1, model="tiny", device="cpu", torch_threads="1") as servers:
        url = servers[0][1]
        vectors, usage = peer.embeddings(url, TEXTS[:2])
        assert len(vectors) == 2 and usage["prompt_tokens"] == sum(tokens)
        row = peer.measure(args, url, TEXTS[:2], tokens, 3, system="fusedserve", phase="serve", batch_size=None)
    assert row["errors"] == 0 and row["requests"] > 3 and row["p50_ms"] <= row["p99_ms"]
    assert abs(row["texts_per_s"] * row["seconds"] - 2 * row["requests"]) < 1e-6
    assert sum(tokens) <= row["tokens_per_s"] * row["seconds"] <= row["requests"] * 2 * max(tokens)
    # the same numbers for both systems: ratio 1 on each, and so not ahead
    same = peer.ratios([row, {**row, "system": "infinity", "batch_size": 32}])
    assert same == {"3": {"tokens_per_s": 1.0, "p50_ms": 1.0, "p99_ms": 1.0, "ours_ahead": False}}
