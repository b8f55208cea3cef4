"""The models users bring, on the GPU's fused kernels in fp16 and bf16, against the real libraries on the same
directories (built offline, fp32 references): SentenceTransformer for XLM-RoBERTa, DistilBERT, MPNet, NomicBERT and
ModernBERT (tiny and their base models' shapes) embedding models, GTE against carried references and for MiniLM re-pooled with a Dense module; CrossEncoder for
classifiers of each architecture. The packed layout, varlen or few-token attention and CUDA graphs are the serving
defaults."""

from __future__ import annotations

import pytest
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer

from fusedserve.model.modules import activate
from fusedserve.model.runner import Embedder
from tests.model import checkpoints
from tests.tolerances import assert_scores_close, tolerance

pytestmark = pytest.mark.gpu


TEXTS = ["A man is eating food.", "x", "Fused kernels make encoders fast, even for a single short request.",
         "The quick brown fox jumps over the lazy dog " * 12,
         "past ModernBERT-base's local window of 64 tokens each side " * 20]
PAIRS = [("how do fused kernels help?", "They cut memory traffic between ops."), ("what is a cat", "A small feline."),
         ("q", "a much longer passage about nothing in particular " * 10)]


def _builds(tmp_path):
    return {
        "minilm-cls-dense": lambda: checkpoints.minilm(tmp_path / "m", ["cls"], dense=[(384, 128, "tanh")]),
        "xlm-roberta": lambda: checkpoints.tiny_xlm_roberta(tmp_path / "x"),
        "distilbert": lambda: checkpoints.tiny_distilbert(tmp_path / "d", ["max"]),
        "mpnet": lambda: checkpoints.mpnet(tmp_path / "mp", ["cls"]),
        # all-mpnet-base-v2's shape (its real weights are a CPU test: too large to carry here)
        "mpnet-base": lambda: checkpoints.mpnet(tmp_path / "mpb", shape="base"),
        "nomic_bert": lambda: checkpoints.nomic_bert(tmp_path / "n"),
        "nomic_bert-base": lambda: checkpoints.nomic_bert(tmp_path / "nb", shape="base"),
        "modernbert": lambda: checkpoints.modernbert(tmp_path / "mb", ["cls"]),
        "modernbert-base": lambda: checkpoints.modernbert(tmp_path / "mbb", shape="base"),
    }


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("model", ["minilm-cls-dense", "xlm-roberta", "distilbert", "mpnet", "mpnet-base",
                                   "nomic_bert", "nomic_bert-base", "modernbert", "modernbert-base"])
def test_embedding_models_on_the_fused_kernels(tmp_path, model, dtype):
    path = _builds(tmp_path)[model]()
    ours, _ = Embedder.load(str(path), device="cuda", dtype=dtype, max_batch_tokens=2048, max_batch=16)
    assert ours.kernel_path.label == "fused"
    reference = SentenceTransformer(str(path), device="cuda").float()
    expected = reference.encode(TEXTS, convert_to_tensor=True).float().cpu()
    for rows in (TEXTS[:1], TEXTS):  # one short input (the few-token layer where it runs) and a mixed batch
        got = ours.embed(rows)
        cosine = torch.nn.functional.cosine_similarity(got.double(), expected[: len(rows)].double(), dim=1)
        assert float(cosine.min()) >= tolerance(dtype).min_cosine, (model, dtype, cosine)
    assert ours.graphs.stats()["replays"] >= 2


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", ["tiny", "base"])
def test_gte_on_the_fused_kernels(tmp_path, shape, dtype):
    """GTE (rotary attention, gated GELU) at a tiny shape and at gte-multilingual-base's. sentence-transformers on
    the GPU where this transformers has GTE; else (the H200 image) the fp32 embeddings sentence-transformers gave
    on the CPU for the same seeded weights (tests/gpu/gte_reference.json; the CPU suite keeps it current)."""
    import json

    import transformers

    carried = json.loads(checkpoints.GTE_REFERENCE.read_text())
    texts = carried["texts"]
    path = checkpoints.gte_seeded(tmp_path / shape, shape)
    if hasattr(transformers, "GteModel"):
        expected = SentenceTransformer(str(path), device="cuda").float().encode(texts, convert_to_tensor=True)
    else:
        assert checkpoints.weights_digest(path) == carried["shapes"][shape]["digest"], "seeded weights differ"
        expected = torch.tensor(carried["shapes"][shape]["embeddings"])
    ours, _ = Embedder.load(str(path), device="cuda", dtype=dtype, max_batch_tokens=2048, max_batch=16)
    path = ours.kernel_path
    assert path.label == "fused" and {"rotary_attention", "linear_glu"} <= set(path.selection.used)
    for rows in (texts[:1], texts):
        got = ours.embed(rows)
        cosine = torch.nn.functional.cosine_similarity(got.double(), expected[: len(rows)].double().cpu(), dim=1)
        assert float(cosine.min()) >= tolerance(dtype).min_cosine, (shape, dtype, cosine)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("architecture", ["bert", "roberta", "distilbert", "mpnet", "modernbert"])
@pytest.mark.parametrize("num_labels", [1, 3])
def test_classifiers_on_the_fused_kernels(tmp_path, architecture, num_labels, dtype):
    path = checkpoints.cross_encoder(tmp_path / "ce", num_labels, architecture)
    ours, _ = Embedder.load(str(path), device="cuda", dtype=dtype, max_batch_tokens=2048, max_batch=16)
    reference = CrossEncoder(str(path), device="cuda")
    reference.model.float()
    expected = torch.as_tensor(reference.predict(PAIRS, apply_softmax=num_labels > 1, convert_to_numpy=True))
    scores = activate(ours.predict(PAIRS), ours.classifier.activation)
    assert_scores_close(scores, expected.reshape(scores.shape), dtype, what=f"{architecture}, {num_labels} labels")
