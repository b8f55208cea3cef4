"""SPLADE models on the GPU's fused head (splade_pool: the vocabulary GEMM with log(1 + relu) and the max over each
input's tokens in its epilogue) in fp16, against sentence-transformers' SparseEncoder fp32 on the GPU on the same
directory: tiny, and splade-v3's width on inputs up to 256 tokens."""

from __future__ import annotations

import pytest
import torch
from sentence_transformers import SparseEncoder

from fusedserve.kernels.registry import REFERENCE_BACKEND
from fusedserve.model.runner import Embedder
from tests.model import checkpoints
from tests.tolerances import assert_sparse_close

pytestmark = pytest.mark.gpu

TEXTS = ["A man is eating food.", "x", "Sparse lexical vectors expand a query over the vocabulary.",
         "a long passage about retrieval with learned sparse representations " * 25]


@pytest.mark.parametrize("shape", ["tiny", "base"])
def test_sparse_models_on_the_fused_head(tmp_path, shape):
    path = checkpoints.splade(tmp_path / "s", shape=shape)
    ours, _ = Embedder.load(str(path), device="cuda", dtype="float16", max_batch_tokens=2048, max_batch=16)
    kernel_path = ours.kernel_path
    assert kernel_path.label == "fused" and kernel_path.selection.backend_of("splade_pool") != REFERENCE_BACKEND
    expected = SparseEncoder(str(path), device="cuda").float().encode(TEXTS, convert_to_tensor=True).to_dense()
    for rows in (TEXTS[:1], TEXTS):
        got = ours.embed(rows, normalize=False)
        assert_sparse_close(got, expected[: len(rows)].cpu(), torch.float16, what=f"{shape}, {len(rows)} inputs")
    assert ours.graphs.stats()["replays"] >= 2
