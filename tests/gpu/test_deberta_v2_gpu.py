"""DeBERTa-v3 on the GPU in float16 and bfloat16 (the serving defaults: packed layout, CUDA graphs, the fused kernels
for the embeddings and post-norm blocks, the disentangled attention in torch), against the real libraries on the same
directories with fp32 references on the GPU: the embedder at a tiny shape and at deberta-v3-base's against
SentenceTransformer (an input past the 256 position buckets included), the cross-encoders (1 label, and 3 as the NLI
models) against CrossEncoder."""

from __future__ import annotations

import pytest
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer

from fusedserve.model.modules import activate
from fusedserve.model.runner import Embedder
from tests.model import checkpoints
from tests.model.test_deberta_v2 import PAIRS, TEXTS
from tests.tolerances import assert_scores_close, tolerance

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", ["tiny", "base"])
def test_deberta_embedders_on_the_gpu(tmp_path, shape, dtype):
    path = checkpoints.deberta_v2(tmp_path / shape, shape=shape)
    ours, _ = Embedder.load(str(path), device="cuda", dtype=dtype, max_batch_tokens=2048, max_batch=16)
    assert ours.kernel_path.label == "fused"
    reference = SentenceTransformer(str(path), device="cuda").float()
    expected = reference.encode(TEXTS, convert_to_tensor=True).float().cpu()
    for rows in (TEXTS[:1], TEXTS):  # one short input and a mixed batch, each from its CUDA graph
        got = ours.embed(rows)
        cosine = torch.nn.functional.cosine_similarity(got.double(), expected[: len(rows)].double(), dim=1)
        assert float(cosine.min()) >= tolerance(dtype).min_cosine, (shape, dtype, cosine)
    assert ours.graphs.stats()["replays"] >= 2


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("num_labels", [1, 3])
def test_deberta_cross_encoders_on_the_gpu(tmp_path, num_labels, dtype):
    path = checkpoints.deberta_v2(tmp_path / "ce", num_labels=num_labels)
    ours, _ = Embedder.load(str(path), device="cuda", dtype=dtype, max_batch_tokens=2048, max_batch=16)
    reference = CrossEncoder(str(path), device="cuda")
    reference.model.float()
    expected = torch.as_tensor(reference.predict(PAIRS, apply_softmax=num_labels > 1, convert_to_numpy=True))
    scores = activate(ours.predict(PAIRS), ours.classifier.activation)
    assert_scores_close(scores, expected.reshape(scores.shape), dtype, what=f"DeBERTa, {num_labels} labels")
