"""Decoder embedders (Qwen3, Qwen2) against sentence-transformers on the same directories (fp32, CPU): causal
grouped-query attention, Qwen3's q/k norms and head width of its own, Qwen2's q/k/v biases, lasttoken pooling over
the <|endoftext|> the tokenizer appends, the instruction prompt, truncation; and Qwen3-Reranker against its model
card's code on transformers' Qwen3ForCausalLM. What the family cannot serve exactly is refused at load, naming it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from sentence_transformers import SentenceTransformer

from fusedserve.model.api import InputTooLong, TextOptions
from fusedserve.model.config import UnsupportedModel
from fusedserve.model.runner import Embedder
from fusedserve.model.weights import CheckpointError
from tests.model import checkpoints
from tests.model.reference import encode_unpadded
from tests.tolerances import assert_scores_close, assert_unit_length, tolerance

TEXTS = ["A man is eating food.", "x", "naïve café, déjà vu, 東京の天気: Unicode through a byte-level BPE.",
         "Fused kernels make decoder embedders fast, even for a single short request. " * 6]
MIN_COSINE = tolerance(torch.float32).min_cosine


def _agree(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    cosine = torch.nn.functional.cosine_similarity(ours.double(), theirs.double(), dim=1)
    assert float(cosine.min()) >= MIN_COSINE, cosine


@pytest.fixture(scope="module", params=["qwen3", "qwen2"])
def qwen_dir(request, tmp_path_factory):
    return checkpoints.qwen(tmp_path_factory.mktemp(request.param) / "m", qwen2=request.param == "qwen2")


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_qwen_embedders_match_sentence_transformers(qwen_dir, layout):
    ours, report = Embedder.load(str(qwen_dir), device="cpu", backend="torch", layout=layout)
    family = json.loads((qwen_dir / "config.json").read_text())["model_type"]
    assert f"architecture {family}" in str(report) and "lasttoken pooling" in str(report)
    reference = SentenceTransformer(str(qwen_dir), device="cpu")
    for prompt in (None, "query"):  # Qwen3-Embedding's instruction before each query, none before documents
        _agree(ours.embed(TEXTS, prompt_name=prompt), encode_unpadded(reference, TEXTS, prompt_name=prompt))
    # the sentence embedding is the last token's: the <|endoftext|> the tokenizer's post-processor appends
    eos = reference.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert all(row[-1] == eos for row in ours.tokenize(TEXTS))


def test_truncation_keeps_the_last_token_as_sentence_transformers_does(qwen_dir):
    ours, _ = Embedder.load(str(qwen_dir), device="cpu", backend="torch", max_seq_length=24)
    reference = SentenceTransformer(str(qwen_dir), device="cpu")
    reference.max_seq_length = 24
    long = [TEXTS[3], TEXTS[3][::-1]]
    rows = ours.tokenize(long, prompt_name="query")
    assert [len(r) for r in rows] == [24, 24] and rows == reference.tokenize(
        [reference.prompts["query"] + t for t in long])["input_ids"].tolist()
    _agree(ours.embed(long, prompt_name="query"), reference.encode(long, prompt_name="query", convert_to_tensor=True))


def test_the_fused_kernels_serve_qwen(qwen_dir):
    """RMSNorm, add + RMSNorm with the next block's weights, causal GQA rotary attention (Qwen3: q/k norms first),
    SwiGLU in the GEMM's epilogue: the Triton kernels on the interpreter here."""
    fused, _ = Embedder.load(str(qwen_dir), device="cpu", backend="triton")
    assert fused.kernel_path.selection.used == {op: "triton" for op in ("rms_norm", "rotary_attention", "add_rms_norm",
                                                            "linear_glu")}
    reference = SentenceTransformer(str(qwen_dir), device="cpu")
    _agree(fused.embed(TEXTS[:3]), encode_unpadded(reference, TEXTS[:3]))


def test_decoder_embedders_default_to_bfloat16_on_a_gpu(qwen_dir):
    from fusedserve.model.families import config_from_dir, family
    from fusedserve.model.loading import resolve_dtype

    cuda = torch.device("cuda")
    assert resolve_dtype("auto", cuda, family(config_from_dir(qwen_dir)).dtype_on_cuda) == torch.bfloat16
    assert resolve_dtype("auto", cuda, family(config_from_dir(checkpoints.source_dir())).dtype_on_cuda) == torch.float16
    assert resolve_dtype("float16", cuda, torch.bfloat16) == torch.float16  # a setting wins


@pytest.mark.parametrize(("change", "named"), [
    ({"auto_map": {"AutoModel": "Alibaba-NLP/gte-Qwen2-7B-instruct--modeling_qwen.Qwen2Model"}}, "custom code"),
    ({"is_causal": False}, "is_causal False"),
    ({"use_sliding_window": True}, "sliding-window attention"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding-window attention"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "type 'yarn'"),
    ({"num_hidden_layers": 3}, "lacks"),
])
def test_what_qwen_cannot_serve_exactly_is_refused_naming_it(qwen_dir, tmp_path, change, named):
    path = tmp_path / "m"
    path.mkdir()
    for item in qwen_dir.iterdir():
        if item.is_file():
            (path / item.name).symlink_to(item)
    (path / "config.json").unlink()
    config = json.loads((qwen_dir / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError, match=named):
        Embedder.load(str(path), device="cpu")


def test_served_with_the_instruction_and_matryoshka_dimensions(tmp_path):
    """Qwen3-Embedding through POST /v1/embeddings with the `openai` client: the query instruction by prompt_name and
    the first `dimensions` of each vector, renormalized, as sentence-transformers' truncate_dim gives them; an input
    over max_batch_tokens served whole."""
    openai = pytest.importorskip("openai")
    from tests.server.conftest import start_server

    path = checkpoints.qwen(tmp_path / "qwen3-embedding")
    reference = SentenceTransformer(str(path), device="cpu", truncate_dim=24)
    # a batch budget below the longest input's tokens: that input runs alone, in a batch of its own
    assert len(reference.tokenize([reference.prompts["query"] + TEXTS[3]])["input_ids"][0]) > 64
    server = start_server(tmp_path, model=str(path), device="cpu", warmup=False, kernel_timing_sample_rate=0,
                          max_batch_tokens=64)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        result = client.embeddings.create(input=TEXTS, model="qwen3-embedding", dimensions=24, encoding_format="float",
                                          extra_body={"prompt_name": "query"})
    finally:
        server.stop()
    ours = torch.tensor([d.embedding for d in result.data])
    _agree(ours, encode_unpadded(reference, TEXTS, prompt_name="query", normalize_embeddings=True))
    assert_unit_length(ours)


# ---- Qwen3-Reranker ------------------------------------------------------------------------------------------------
PAIRS = [("how do fused kernels help?", "They cut memory traffic between ops."), ("what is a cat", "A small feline."),
         ("q", "a long passage about {braces} and nothing in particular " * 30), ("same", "same")]
RERANK_LENGTH = 256  # the tiny tokenizer spends ~170 tokens on the template: the long passage is cut


def _reference_scores(path, pairs, max_length: int) -> tuple[list[list[int]], torch.Tensor]:
    """Qwen3-Reranker's model-card code on transformers' Qwen3ForCausalLM: each pair formatted into the template,
    tokenized with truncation to what the template leaves, then log-softmax over the "no" and "yes" logits at the last
    position; returns the token rows and the log-odds of yes (logit_yes - logit_no)."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from fusedserve.model.qwen3 import QWEN3_RERANKER as t

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = Qwen3ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prefix = tokenizer.encode(t.prefix, add_special_tokens=False)
    suffix = tokenizer.encode(t.suffix, add_special_tokens=False)
    texts = [t.body.format(instruction=t.instruction, query=q, document=d) for q, d in pairs]
    inputs = tokenizer(texts, padding=False, truncation="longest_first", return_attention_mask=False,
                       max_length=max_length - len(prefix) - len(suffix))
    rows = [prefix + ids + suffix for ids in inputs["input_ids"]]
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    with torch.no_grad():
        last = [model(torch.tensor([row])).logits[0, -1] for row in rows]
    return rows, torch.stack([logits[yes] - logits[no] for logits in last])


@pytest.mark.parametrize("tied", [True, False], ids=["tied-lm-head", "own-lm-head"])
def test_the_reranker_matches_transformers(tmp_path, tied):
    path = checkpoints.qwen3_reranker(tmp_path / "reranker", tied=tied)
    rows, log_odds = _reference_scores(path, PAIRS, RERANK_LENGTH)
    ours, report = Embedder.load(str(path), device="cpu", backend="torch", max_seq_length=RERANK_LENGTH)
    assert "Qwen3 yes/no reranker" in str(report) and ours.kind == "classifier"
    assert ours.tokenize_pairs(PAIRS) == rows and len(rows[2]) == RERANK_LENGTH
    logits = ours.predict(PAIRS)
    assert logits.shape == (len(PAIRS), 1)
    assert_scores_close(logits[:, 0], log_odds, logits=True)
    assert_scores_close(torch.sigmoid(logits[:, 0]), torch.softmax(torch.stack([-log_odds, 0 * log_odds], 1), 1)[:, 1])
    with pytest.raises(InputTooLong):  # truncate=false: the long passage is refused, not cut
        ours.predict(PAIRS, truncate=False)


def test_the_reranker_is_served_on_the_rerank_routes(tmp_path):
    """TEI's /rerank and the Cohere-style /v1/rerank with the probability of "yes" as the score (raw_scores: its
    log-odds)."""
    import httpx

    from tests.server.conftest import start_server

    path = checkpoints.qwen3_reranker(tmp_path / "reranker")
    query, documents = PAIRS[0][0], [d for _, d in PAIRS]
    # the tiny config's 1,024 positions bound max_seq_length; TEI's /rerank refuses an over-long input unless truncate
    _, log_odds = _reference_scores(path, [(query, d) for d in documents], 1024)
    expected = torch.sigmoid(log_odds)
    server = start_server(tmp_path, model=str(path), device="cpu", warmup=False, kernel_timing_sample_rate=0)
    try:
        tei = httpx.post(server.url + "/rerank", json={"query": query, "texts": documents, "truncate": True},
                         timeout=60)
        raw = httpx.post(server.url + "/rerank", json={"query": query, "texts": documents, "raw_scores": True,
                                                       "truncate": True}, timeout=60)
        cohere = httpx.post(server.url + "/v1/rerank", json={"query": query, "documents": documents, "top_n": 2},
                            timeout=60)
    finally:
        server.stop()
    assert tei.status_code == raw.status_code == cohere.status_code == 200, (tei.text, cohere.text)
    ranked = tei.json()
    assert [x["index"] for x in ranked] == sorted(range(len(documents)), key=lambda i: -float(expected[i]))
    assert_scores_close([x["score"] for x in ranked], [float(expected[x["index"]]) for x in ranked])
    assert_scores_close([x["score"] for x in raw.json()], [float(log_odds[x["index"]]) for x in raw.json()],
                        logits=True)
    top = cohere.json()["results"]
    assert [r["index"] for r in top] == [x["index"] for x in ranked[:2]]
    assert_scores_close([r["relevance_score"] for r in top], [x["score"] for x in ranked[:2]])


def test_a_causal_lm_the_family_cannot_rerank_with_is_refused(tmp_path):
    qwen2 = checkpoints.qwen(tmp_path / "qwen2", qwen2=True)
    config = json.loads((qwen2 / "config.json").read_text())
    (qwen2 / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2ForCausalLM"]}))
    with pytest.raises(UnsupportedModel, match="Qwen2 causal LM \\(Qwen2ForCausalLM\\) is not served"):
        Embedder.load(str(qwen2), device="cpu")
    path = checkpoints.qwen3_reranker(tmp_path / "reranker", tied=False)
    tensors = load_file(path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(UnsupportedModel, match="no lm_head.weight and tie_word_embeddings is not set"):
        Embedder.load(str(path), device="cpu")


def test_left_truncation_keeps_the_appended_token(qwen_dir):
    """TEI's truncation_direction "left" drops the start of the text, not the <|endoftext|> the tokenizer appends
    (lasttoken pooling reads it), as the tokenizer's own left truncation does."""
    ours, _ = Embedder.load(str(qwen_dir), device="cpu", backend="torch", max_seq_length=24)
    reference = SentenceTransformer(str(qwen_dir), device="cpu")
    whole = reference.tokenizer(TEXTS[3])["input_ids"]
    left = ours.text.texts([TEXTS[3]], TextOptions(direction="left")).tolist()[0]
    assert len(whole) > 24 and left == whole[-24:] and left[-1] == whole[-1]
