"""Decoder embedders and the LLM reranker on the GPU's fused kernels, against the real libraries on the same
directories with fp32 references on the GPU: Qwen3 and Qwen2 embedders (tiny, and Qwen3-Embedding-0.6B's shape) in
float16 and bfloat16 against SentenceTransformer, one input of 32,768 tokens (the model's whole window, past the
batch token budget: eager, alone) against the float32 torch path, and Qwen3-Reranker against its model card's code
on Qwen3ForCausalLM."""

from __future__ import annotations

import pytest
import torch
from sentence_transformers import SentenceTransformer

from fusedserve.model.runner import Embedder
from tests.model import checkpoints
from tests.model.test_qwen import PAIRS, RERANK_LENGTH, TEXTS, _reference_scores
from tests.tolerances import assert_scores_close, tolerance

pytestmark = pytest.mark.gpu

LONG_TOKENS = 32768


@pytest.fixture(scope="module")
def qwen3_06b(tmp_path_factory):
    return checkpoints.qwen(tmp_path_factory.mktemp("qwen3-0.6b") / "m", "0.6b")


def _agree(got: torch.Tensor, expected: torch.Tensor, dtype: str, what: str) -> None:
    cosine = torch.nn.functional.cosine_similarity(got.double(), expected.double(), dim=1)
    assert float(cosine.min()) >= tolerance(dtype).min_cosine, (what, dtype, cosine)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("model", ["qwen3", "qwen2", "qwen3-0.6b"])
def test_qwen_embedders_on_the_fused_kernels(tmp_path, request, model, dtype):
    path = (request.getfixturevalue("qwen3_06b") if model == "qwen3-0.6b" else
            checkpoints.qwen(tmp_path / model, qwen2=model == "qwen2"))
    ours, _ = Embedder.load(str(path), device="cuda", dtype=dtype, max_batch_tokens=2048, max_batch=16)
    assert ours.kernel_path.label == "fused" and set(ours.kernel_path.selection.used.values()) == {"triton"}
    reference = SentenceTransformer(str(path), device="cuda").float()
    for prompt in (None, "query"):
        expected = reference.encode(TEXTS, prompt_name=prompt, convert_to_tensor=True).float().cpu()
        for rows in (TEXTS[:1], TEXTS):  # one short input and a mixed batch, each from its CUDA graph
            _agree(ours.embed(rows, prompt_name=prompt), expected[: len(rows)], dtype, f"{model} {prompt}")
    assert ours.graphs.stats()["replays"] >= 4


def test_a_32k_token_input_is_served_whole(qwen3_06b, record_property):
    """Qwen3-Embedding's whole window in one input, over the batch token budget (16,384): it runs alone and eagerly
    (no CUDA graph is that large), with no [tokens, tokens] buffer; the default dtype on a GPU, bfloat16. The
    reference is the torch path in float32 on the same GPU (sentence-transformers' parity is checked on the inputs
    above: at this length transformers' SDPA call with grouped-query heads falls to the math kernel, whose
    [heads, tokens, tokens] float32 scores are 64 GiB)."""
    ours, report = Embedder.load(str(qwen3_06b), device="cuda", max_batch_tokens=16384)
    assert ours.dtype == torch.bfloat16 and ours.config.max_seq_length == LONG_TOKENS
    text = " ".join(checkpoints._BPE_CORPUS) * 400
    rows = ours.tokenize([text])
    assert len(rows[0]) == LONG_TOKENS  # truncated at the window
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated()
    got = ours.embed([text])
    peak_mib = (torch.cuda.max_memory_allocated() - held) / 2**20
    # the forward's working set: a few [tokens, width] activations (the widest, the gated FFN's 2 x 3072), not the
    # [heads, tokens, tokens] scores (16 x 32768^2 x 2 bytes = 32 GiB)
    assert peak_mib < 2048, peak_mib
    record_property("peak_mib_over_weights", round(peak_mib))  # in the JUnit report (--junitxml)
    del ours
    reference, _ = Embedder.load(str(qwen3_06b), device="cuda", dtype="float32", fused=False, cuda_graphs=False)
    _agree(got, reference.embed([text]), "bfloat16", "32k")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_reranker_on_the_fused_kernels(tmp_path, dtype):
    path = checkpoints.qwen3_reranker(tmp_path / "reranker")
    rows, log_odds = _reference_scores(path, PAIRS, RERANK_LENGTH)  # fp32, on the CPU
    ours, _ = Embedder.load(str(path), device="cuda", dtype=dtype, max_seq_length=RERANK_LENGTH)
    assert ours.kernel_path.label == "fused" and ours.tokenize_pairs(PAIRS) == rows
    assert_scores_close(torch.sigmoid(ours.predict(PAIRS)[:, 0]), torch.sigmoid(log_odds), dtype)
