"""Our encoder on the packaged all-MiniLM-L6-v2 vs sentence-transformers on the same directory."""

from __future__ import annotations

import pytest
import torch
from sentence_transformers import SentenceTransformer

from fusedserve.model.runner import Embedder
from fusedserve.model.weights import default_model_dir
from tests.model.sentences import SENTENCES
from tests.tolerances import assert_embeddings_close, assert_unit_length, embedding_errors


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder.load("default", device="cpu", dtype="float32", backend="torch")[0]


@pytest.fixture(scope="module")
def reference_embeddings() -> torch.Tensor:
    st = SentenceTransformer(str(default_model_dir()), device="cpu")
    assert st.max_seq_length == 256
    return torch.from_numpy(st.encode(SENTENCES, batch_size=16, convert_to_numpy=True))


def test_matches_sentence_transformers(embedder, reference_embeddings, record_property):
    ours = torch.cat([embedder.embed(SENTENCES[i : i + 16]) for i in range(0, len(SENTENCES), 16)])
    assert ours.shape == reference_embeddings.shape == (len(SENTENCES), 384)
    min_cosine, max_abs = embedding_errors(ours, reference_embeddings)
    record_property("max_abs_error", max_abs)
    record_property("min_cosine", min_cosine)
    print(f"\nparity over {len(SENTENCES)} sentences: min cosine {min_cosine:.9f}, max abs error {max_abs:.3e}")
    cosine = torch.nn.functional.cosine_similarity(ours.double(), reference_embeddings.double(), dim=1)
    worst = int(cosine.argmin())
    assert_embeddings_close(ours, reference_embeddings, what=f"worst: sentence {worst} {SENTENCES[worst][:60]!r}")
    assert_unit_length(ours)  # normalized, as the model's Normalize module does


def test_truncation_matches_sentence_transformers(embedder):
    st = SentenceTransformer(str(default_model_dir()), device="cpu")
    long_text = SENTENCES[-6]  # hundreds of number tokens
    theirs = st.tokenize([long_text])["input_ids"][0].tolist()
    ours = embedder.tokenizer.encode([long_text])[0]
    assert len(ours) == 256 and ours == theirs


def test_triton_backend_on_interpreter_matches_sentence_transformers(reference_embeddings):
    """The real model through the Triton kernels (interpreted here; on the H200 in tests/gpu)."""
    embedder = Embedder.load("default", device="cpu", dtype="float32", backend="triton")[0]
    picked = [0, 10, 28, 33]  # short English, unicode, emoji, numbers
    assert_embeddings_close(embedder.embed([SENTENCES[i] for i in picked]), reference_embeddings[picked])
