"""EmbeddingGemma on the GPU: the tiny model (a window of 8, so every input here crosses it) and embeddinggemma-300m's
widths at two layers (3 query heads of 256 over one key/value head, a window of 512) in bfloat16, its default on a
GPU, against sentence-transformers in float32 on the same GPU; one input three times the 300m window long, eager and
alone, against the float32 torch path; float16 refused by name."""

from __future__ import annotations

import pytest
import torch
from sentence_transformers import SentenceTransformer

from fusedserve.model.config import UnsupportedModel
from fusedserve.model.runner import Embedder
from tests.model import checkpoints
from tests.model.test_gemma3 import TEXTS
from tests.tolerances import tolerance

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gemma_300m_widths(tmp_path_factory):
    return checkpoints.gemma3(tmp_path_factory.mktemp("gemma3-300m-2l") / "m", "300m-2l", sliding_window=512,
                              max_seq_length=2048, dense=(3072, 768))


def _agree(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    cosine = torch.nn.functional.cosine_similarity(got.double(), expected.double(), dim=1)
    assert float(cosine.min()) >= tolerance(torch.bfloat16).min_cosine, (what, cosine)


@pytest.mark.parametrize("model", ["tiny", "300m-2l"])
def test_embeddinggemma_in_bfloat16_on_the_gpu(tmp_path, request, model):
    path = (request.getfixturevalue("gemma_300m_widths") if model == "300m-2l" else
            checkpoints.gemma3(tmp_path / model))
    ours, report = Embedder.load(str(path), device="cuda", max_batch_tokens=2048, max_batch=16)
    # every op the model calls on a fused backend (the race may pick CUDA's norms at these widths)
    used = set(report.kernels.used.values())
    assert ours.dtype == torch.bfloat16 and used and used <= {"triton", "cuda"}, used
    reference = SentenceTransformer(str(path), device="cuda").float()
    for prompt in (None, "query", "document"):
        expected = reference.encode(TEXTS, prompt_name=prompt, convert_to_tensor=True).float().cpu()
        for rows in (TEXTS[:1], TEXTS):  # one short input and a mixed batch, each from its CUDA graph
            _agree(ours.embed(rows, prompt_name=prompt), expected[: len(rows)], f"{model} {prompt}")
    assert ours.graphs.stats()["replays"] >= 4


def test_an_input_longer_than_the_window_in_bfloat16(gemma_300m_widths):
    ours, _ = Embedder.load(str(gemma_300m_widths), device="cuda", max_batch_tokens=2048)
    text = " ".join(TEXTS) * 20
    rows = ours.tokenize([text], prompt_name="document")
    assert 1536 < len(rows[0]) <= 2048
    got = ours.embed([text], prompt_name="document")
    del ours
    reference, _ = Embedder.load(str(gemma_300m_widths), device="cuda", dtype="float32", fused=False,
                                 cuda_graphs=False)
    _agree(got, reference.embed([text], prompt_name="document"), "longer than the window")


def test_float16_is_refused_naming_it(tmp_path):
    path = checkpoints.gemma3(tmp_path / "m")
    with pytest.raises(UnsupportedModel, match="dtype float16 is not supported by EmbeddingGemma"):
        Embedder.load(str(path), device="cuda", dtype="float16")
