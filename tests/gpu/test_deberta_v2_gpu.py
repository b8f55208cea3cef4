"""DeBERTa-v3 on the GPU in float16 and bfloat16 (the serving defaults: packed layout, CUDA graphs, the fused kernels
for the embeddings, the post-norm blocks and the disentangled attention), against the real libraries on the same
directories with fp32 references on the GPU: the embedder at a tiny shape and at deberta-v3-base's against
SentenceTransformer (an input past the 256 position buckets included), the cross-encoders (1 label, and 3 as the NLI
models) against CrossEncoder; and the fused path's attention against the reference path's on the same batches."""

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
    assert ours.kernel_path.selection.used["disentangled_attention"] == "triton"
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


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_fused_attention_matches_the_reference_path_at_base_shape(tmp_path, dtype):
    """deberta-v3-base's shape: the packed forward on the fused path (kernels.disentangled_attention) against the same
    encoder's reference path (the position terms in SDPA's mask), token by token, on a batch of mixed lengths up to
    the model's 512 positions (v3's log buckets past 128 apart, several key blocks)."""
    from fusedserve import kernels
    from fusedserve.model.packing import Packed
    from fusedserve.model.weights import load_encoder

    torch_dtype = getattr(torch, dtype)
    path = checkpoints.deberta_v2(tmp_path / "base", shape="base")
    encoder = load_encoder(path).to("cuda", torch_dtype).eval()
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(4, encoder.config.vocab_size, (n,), generator=gen).tolist() for n in (1, 7, 130, 300, 511)]
    p = Packed.from_rows(rows, "cuda")
    selection = kernels.select("cuda", (torch_dtype,), backend="triton", ops=("disentangled_attention",))
    assert selection.backend_of("disentangled_attention") == "triton"
    with torch.inference_mode():
        reference = encoder.forward_packed(p, "varlen").float()
        with kernels.use(selection):
            fused = encoder.forward_packed(p, "varlen").float()
    cosine = torch.nn.functional.cosine_similarity(fused.double(), reference.double(), dim=1)
    assert float(cosine.min()) >= tolerance(dtype).min_cosine, cosine
