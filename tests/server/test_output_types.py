"""Output types per request on /infer, /v1/embeddings (`encoding_format`) and /embed: base64 carries the float32
bytes, and int8 / uint8 / binary / ubinary equal sentence-transformers' quantize_embeddings on the same vectors,
with the calibration ranges the server publishes in /info (the per-dimension range of its calibration texts)."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
from sentence_transformers.util import quantization

from fusedserve.model.api import l2_normalize
from fusedserve.server.quantize import CALIBRATION_TEXTS
from tests.model.sentences import SENTENCES
from tests.tolerances import assert_quantized_close, tolerance

TEXTS = SENTENCES[:6] + ["hello", "東京は日本の首都です。"]
QUANTIZED = ["int8", "uint8", "binary", "ubinary"]


def post(server, path, body):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def floats(server) -> np.ndarray:
    return np.array(post(server, "/infer", {"inputs": TEXTS})["embeddings"], dtype=np.float32)


@pytest.fixture(scope="module")
def ranges(server) -> np.ndarray:
    info = httpx.get(server.url + "/info").json()["quantization"]
    assert info["calibration_texts"] == len(CALIBRATION_TEXTS)
    return np.array(info["ranges"], dtype=np.float32)


def expected(vectors: np.ndarray, precision: str, ranges: np.ndarray | None) -> np.ndarray:
    return quantization.quantize_embeddings(vectors, precision, ranges=ranges if precision.endswith("int8") else None)


def test_the_published_ranges_are_those_of_the_calibration_texts(server, ranges):
    raw = np.concatenate([post(server, "/infer", {"inputs": list(CALIBRATION_TEXTS[i: i + 32]), "normalize": False}
                               )["embeddings"] for i in range(0, len(CALIBRATION_TEXTS), 32)]).astype(np.float32)
    calibration = l2_normalize(raw)
    # the server embedded the calibration texts in batches of its own: equal within the float32 table
    np.testing.assert_allclose(ranges, [calibration.min(axis=0), calibration.max(axis=0)], rtol=0,
                               atol=tolerance().max_abs)
    assert ranges.shape == (2, 384) and (ranges[0] < ranges[1]).all()


@pytest.mark.parametrize("precision", QUANTIZED)
def test_quantized_types_equal_sentence_transformers(server, floats, ranges, precision):
    want = expected(floats, precision, ranges)
    width = 384 if precision.endswith("int8") else 48  # packed bits: 8 dimensions a byte
    infer = np.array(post(server, "/infer", {"inputs": TEXTS, "encoding_format": precision})["embeddings"])
    tei = np.array(post(server, "/embed", {"inputs": TEXTS, "encoding_format": precision}))
    openai = post(server, "/v1/embeddings", {"input": TEXTS, "encoding_format": precision})
    openai = np.array([d["embedding"] for d in openai["data"]])
    for got in (infer, tei, openai):
        assert got.shape == (len(TEXTS), width)
        np.testing.assert_array_equal(got, want.astype(np.int64))


def test_base64_is_the_float32_bytes(server, floats):
    for rows in (post(server, "/infer", {"inputs": TEXTS, "encoding_format": "base64"})["embeddings"],
                 post(server, "/embed", {"inputs": TEXTS, "encoding_format": "base64"}),
                 [d["embedding"] for d in post(server, "/v1/embeddings", {"input": TEXTS, "encoding_format": "base64"}
                                               )["data"]]):
        decoded = np.stack([np.frombuffer(base64.b64decode(row), dtype="<f4") for row in rows])
        np.testing.assert_array_equal(decoded, floats)


def test_raw_and_shortened_embeddings_calibrate_alike(server, floats):
    """normalize=false and `dimensions` quantize against the calibration embeddings shaped the same way."""
    raw = np.concatenate([post(server, "/infer", {"inputs": list(CALIBRATION_TEXTS[i: i + 32]), "normalize": False}
                               )["embeddings"] for i in range(0, len(CALIBRATION_TEXTS), 32)]).astype(np.float32)
    vectors = np.array(post(server, "/embed", {"inputs": TEXTS, "normalize": False}), dtype=np.float32)
    got = np.array(post(server, "/embed", {"inputs": TEXTS, "normalize": False, "encoding_format": "uint8"}))
    want = quantization.quantize_embeddings(vectors, "uint8", calibration_embeddings=raw)
    assert_quantized_close(got, want, what="uint8 of raw embeddings")
    short = l2_normalize(floats[:, :100])
    got = np.array([d["embedding"] for d in post(server, "/v1/embeddings", {
        "input": TEXTS, "dimensions": 100, "encoding_format": "int8"})["data"]])
    want = quantization.quantize_embeddings(short, "int8", calibration_embeddings=l2_normalize(raw[:, :100]))
    assert got.shape == (len(TEXTS), 100)
    assert_quantized_close(got, want, what="int8 of 100 dimensions")
    bits = np.array(post(server, "/embed", {"inputs": TEXTS, "dimensions": 20, "encoding_format": "ubinary"}))
    np.testing.assert_array_equal(bits, quantization.quantize_embeddings(l2_normalize(floats[:, :20]), "ubinary"))
    assert bits.shape == (len(TEXTS), 3)  # 20 bits padded to 3 bytes


def test_unknown_output_type_is_refused(server):
    for path, body in (("/infer", {"inputs": "a", "encoding_format": "int4"}),
                       ("/embed", {"inputs": "a", "encoding_format": "float16"}),
                       ("/v1/embeddings", {"input": "a", "encoding_format": "hex"})):
        assert httpx.post(server.url + path, json=body, timeout=60).status_code == 422
