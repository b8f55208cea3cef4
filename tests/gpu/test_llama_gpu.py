"""Llama and Mistral embedders on the GPU's fused kernels, against sentence-transformers on the same directories with
fp32 references on the GPU: tiny Llama and Mistral in bfloat16 (their default on a GPU) and float16, Mistral-7B's
widths at two layers (head width 128, 32 query heads over 8 key/value heads) in bfloat16, and one input as long as
Mistral's sliding window (4,096 tokens, the served max_seq_length: eager, alone) against the float32 torch path.

sentence-transformers gets tokenizer_config.json's add_bos_token / add_eos_token as explicit arguments
(tests/model/test_llama.py says why)."""

from __future__ import annotations

import pytest
import torch
from sentence_transformers import SentenceTransformer

from fusedserve.model.runner import Embedder
from tests.model import checkpoints
from tests.model.test_llama import EOS, TEXTS
from tests.tolerances import tolerance

pytestmark = pytest.mark.gpu

WINDOW = 4096
PROMPT = "web_search_query"


@pytest.fixture(scope="module")
def mistral_7b_widths(tmp_path_factory):
    return checkpoints.llama(tmp_path_factory.mktemp("mistral-7b-2l") / "m", "7b-2l", mistral=True,
                             max_seq_length=WINDOW)


def _agree(got: torch.Tensor, expected: torch.Tensor, dtype: str, what: str) -> None:
    cosine = torch.nn.functional.cosine_similarity(got.double(), expected.double(), dim=1)
    assert float(cosine.min()) >= tolerance(dtype).min_cosine, (what, dtype, cosine)


@pytest.mark.parametrize(("model", "dtype"), [("llama", "bfloat16"), ("mistral", "bfloat16"), ("llama", "float16"),
                                              ("mistral", "float16"), ("mistral-7b-2l", "bfloat16")])
def test_llama_embedders_on_the_fused_kernels(tmp_path, request, model, dtype):
    path = (request.getfixturevalue("mistral_7b_widths") if model == "mistral-7b-2l" else
            checkpoints.llama(tmp_path / model, mistral=model == "mistral"))
    ours, report = Embedder.load(str(path), device="cuda", dtype=dtype, max_batch_tokens=2048, max_batch=16)
    assert set(report.kernels.used.values()) == {"triton"}
    reference = SentenceTransformer(str(path), device="cuda", processor_kwargs=checkpoints.TOKEN_FLAGS).float()
    for prompt in (None, PROMPT):
        expected = reference.encode(TEXTS, prompt_name=prompt, convert_to_tensor=True).float().cpu()
        for rows in (TEXTS[:1], TEXTS):  # one short input and a mixed batch, each from its CUDA graph
            _agree(ours.embed(rows, prompt_name=prompt), expected[: len(rows)], dtype, f"{model} {prompt}")
    assert ours.graphs.stats()["replays"] >= 4


def test_an_input_as_long_as_the_window_is_served_whole(mistral_7b_widths):
    """max_seq_length at Mistral's window: an input cut to 4,096 tokens, its EOS kept, attends to every key before it
    (the window hides none); the default dtype on a GPU, bfloat16, against the float32 torch path on the same GPU."""
    ours, _ = Embedder.load(str(mistral_7b_widths), device="cuda", max_batch_tokens=2048)
    assert ours.dtype == torch.bfloat16 and ours.config.max_seq_length == WINDOW
    text = " ".join(TEXTS) * 200
    rows = ours.tokenize([text], prompt_name=PROMPT)
    assert len(rows[0]) == WINDOW and rows[0][-1] == EOS
    got = ours.embed([text], prompt_name=PROMPT)
    del ours
    reference, _ = Embedder.load(str(mistral_7b_widths), device="cuda", dtype="float32", fused=False,
                                 cuda_graphs=False)
    _agree(got, reference.embed([text], prompt_name=PROMPT), "bfloat16", "window-long")
