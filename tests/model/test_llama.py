"""Llama and Mistral decoder embedders (e5-mistral-7b-instruct's layout) against sentence-transformers and against
transformers' LlamaModel / MistralModel on the same directories (fp32, CPU): causal grouped-query attention, Mistral's
head width of its own, lasttoken pooling over the EOS that tokenizer_config.json's add_eos_token appends, the
instruction prompts, truncation; Mistral's sliding window served where it is at least max_seq_length and refused
where shorter; what the families cannot serve exactly refused at load, naming it.

sentence-transformers loads the tokenizer through transformers 5, which drops add_bos_token / add_eos_token from a
tokenizer_config.json beside a tokenizer.json: the reference gets them as explicit arguments (processor_kwargs), as
transformers 4 read them from the config."""

from __future__ import annotations

import json

import pytest
import torch
from sentence_transformers import SentenceTransformer

from fusedserve.model.config import UnsupportedModel
from fusedserve.model.runner import Embedder
from fusedserve.model.weights import CheckpointError
from tests.model import checkpoints
from tests.model.reference import encode_unpadded
from tests.tolerances import tolerance

TEXTS = ["A man is eating food.", "x", "naïve café, déjà vu, 東京の天気, Ω 🙂: bytes through the fallback.",
         "Fused kernels make decoder embedders fast, even for a single short request. " * 6]
PROMPTS = (None, "web_search_query")
MIN_COSINE = tolerance(torch.float32).min_cosine
BOS, EOS = 1, 2  # llama_tokenizer's <s>, </s>


def _agree(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    cosine = torch.nn.functional.cosine_similarity(ours.double(), theirs.double(), dim=1)
    assert float(cosine.min()) >= MIN_COSINE, cosine


def _sentence_transformer(path) -> SentenceTransformer:
    return SentenceTransformer(str(path), device="cpu", processor_kwargs=checkpoints.TOKEN_FLAGS)


def _transformers_last_token(path, rows: list[list[int]]) -> torch.Tensor:
    """transformers' LlamaModel / MistralModel on each token row alone: the last position's hidden state."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.stack([model(torch.tensor([row])).last_hidden_state[0, -1] for row in rows])


@pytest.fixture(scope="module", params=["llama", "mistral"])
def llama_dir(request, tmp_path_factory):
    return checkpoints.llama(tmp_path_factory.mktemp(request.param) / "m", mistral=request.param == "mistral")


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_llama_embedders_match_sentence_transformers(llama_dir, layout):
    ours, report = Embedder.load(str(llama_dir), device="cpu", backend="torch", layout=layout)
    model_type = json.loads((llama_dir / "config.json").read_text())["model_type"]
    assert f"architecture {model_type}" in str(report) and "lasttoken pooling" in str(report)
    reference = _sentence_transformer(llama_dir)
    for prompt in PROMPTS:  # e5-mistral's instruction before each query, none before documents
        embedded = ours.embed(TEXTS, prompt_name=prompt)
        _agree(embedded, encode_unpadded(reference, TEXTS, prompt_name=prompt))
        _agree(torch.cat([ours.embed([t], prompt_name=prompt) for t in TEXTS]), embedded)  # batched == alone
        rows = ours.tokenize(TEXTS, prompt_name=prompt)
        prompted = [reference.prompts[prompt] + t for t in TEXTS] if prompt else TEXTS
        assert rows == [reference.tokenize([t])["input_ids"][0].tolist() for t in prompted]
    # the sentence embedding is the last token's: the </s> tokenizer_config.json's add_eos_token appends
    assert all(row[0] == BOS and row[-1] == EOS for row in rows)


def test_llama_embedders_match_transformers_last_token_states(llama_dir):
    """The normalized embedding is the direction of LlamaModel's / MistralModel's final hidden state at the appended
    EOS, the prompt before the text."""
    ours, _ = Embedder.load(str(llama_dir), device="cpu", backend="torch")
    for prompt in PROMPTS:
        rows = ours.tokenize(TEXTS, prompt_name=prompt)
        _agree(ours.embed(TEXTS, prompt_name=prompt), _transformers_last_token(llama_dir, rows))


def test_truncation_keeps_the_appended_eos(llama_dir):
    ours, _ = Embedder.load(str(llama_dir), device="cpu", backend="torch", max_seq_length=24)
    reference = _sentence_transformer(llama_dir)
    reference.max_seq_length = 24
    long = [TEXTS[3], TEXTS[3][::-1]]
    rows = ours.tokenize(long, prompt_name="web_search_query")
    assert [len(r) for r in rows] == [24, 24] and all(r[-1] == EOS for r in rows)
    assert rows == reference.tokenize([reference.prompts["web_search_query"] + t for t in long])["input_ids"].tolist()
    _agree(ours.embed(long, prompt_name="web_search_query"),
           reference.encode(long, prompt_name="web_search_query", convert_to_tensor=True))


def test_the_fused_kernels_serve_llama(llama_dir):
    """RMSNorm, add + RMSNorm with the next block's weights, causal GQA rotary attention, SwiGLU in the GEMM's
    epilogue: the Triton kernels on the interpreter here."""
    fused, report = Embedder.load(str(llama_dir), device="cpu", backend="triton")
    assert report.kernels.used == {op: "triton" for op in ("rms_norm", "rotary_attention", "add_rms_norm",
                                                           "linear_glu")}
    _agree(fused.embed(TEXTS[:3], prompt_name="web_search_query"),
           encode_unpadded(_sentence_transformer(llama_dir), TEXTS[:3], prompt_name="web_search_query"))


def test_decoder_embedders_default_to_bfloat16_on_a_gpu(llama_dir):
    from fusedserve.model.families import config_from_dir, family

    assert family(config_from_dir(llama_dir)).dtype_on_cuda == torch.bfloat16


# ---- Mistral's sliding window -------------------------------------------------------------------------------------

def test_a_window_at_least_max_seq_length_is_served(tmp_path):
    """A 64-token window and max_seq_length 64: every input fits the window, so MistralModel's windowed mask hides no
    key; an input longer than that is cut to 64 tokens first, its EOS kept."""
    path = checkpoints.llama(tmp_path / "m", mistral=True, sliding_window=64, max_seq_length=64)
    ours, _ = Embedder.load(str(path), device="cpu", backend="torch")
    assert ours.config.max_seq_length == 64
    rows = ours.tokenize(TEXTS, prompt_name="web_search_query")
    assert len(rows[3]) == 64 and rows[3][-1] == EOS
    embedded = ours.embed(TEXTS, prompt_name="web_search_query")
    _agree(embedded, _transformers_last_token(path, rows))
    _agree(embedded, encode_unpadded(_sentence_transformer(path), TEXTS, prompt_name="web_search_query"))
    with pytest.raises(UnsupportedModel, match="sliding_window 64 is shorter than max_seq_length 65"):
        Embedder.load(str(path), device="cpu", max_seq_length=65)  # a longer served length, set after the load
    assert Embedder.load(str(path), device="cpu", max_seq_length=32)[0].config.max_seq_length == 32


def test_a_window_shorter_than_max_seq_length_is_refused_naming_both(tmp_path):
    path = checkpoints.llama(tmp_path / "m", mistral=True, sliding_window=48, max_seq_length=64)
    with pytest.raises(UnsupportedModel, match="sliding_window 48 is shorter than max_seq_length 64"):
        Embedder.load(str(path), device="cpu")


def test_the_window_read_from_config_json():
    """MistralConfig's default window (4096) where config.json names none, none where it is null; Llama has none."""
    from fusedserve.model.families import config_from_hf, family
    from fusedserve.model.llama import SlidingWindow

    hf = {"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
          "intermediate_size": 64, "max_position_embeddings": 8192}
    unnamed = config_from_hf({**hf, "model_type": "mistral"})
    assert unnamed.section == SlidingWindow(4096) and unnamed.max_seq_length == 8192
    with pytest.raises(UnsupportedModel, match="sliding_window 4096 is shorter than max_seq_length 8192"):
        family(unnamed).encoder(unnamed)
    assert family(unnamed).encoder(unnamed.replace(max_seq_length=4096)).config.max_seq_length == 4096
    for config in (config_from_hf({**hf, "model_type": "mistral", "sliding_window": None}),
                   config_from_hf({**hf, "model_type": "llama", "sliding_window": 16})):  # LlamaModel has no window
        assert config.section is None and family(config).encoder(config).config.max_seq_length == 8192


# ---- layouts and refusals -----------------------------------------------------------------------------------------

def test_a_causal_lm_checkpoint_layout_loads_and_a_causal_lm_is_refused(tmp_path, llama_dir):
    """The weights under a *ForCausalLM's "model." prefix, with its LM head, load as the model's own (the head unused);
    a *ForCausalLM directory is a causal LM, which these families do not serve."""
    mistral = json.loads((llama_dir / "config.json").read_text())["model_type"] == "mistral"
    prefixed = checkpoints.llama(tmp_path / "prefixed", mistral=mistral, prefix="model.")
    plain, _ = Embedder.load(str(llama_dir), device="cpu", backend="torch")
    ours, _ = Embedder.load(str(prefixed), device="cpu", backend="torch")
    _agree(ours.embed(TEXTS), plain.embed(TEXTS))
    config = json.loads((prefixed / "config.json").read_text())
    causal = config["architectures"][0].replace("Model", "ForCausalLM")
    (prefixed / "config.json").write_text(json.dumps({**config, "architectures": [causal]}))
    with pytest.raises(UnsupportedModel, match=f"causal LM \\({causal}\\) is not served"):
        Embedder.load(str(prefixed), device="cpu")


@pytest.mark.parametrize(("change", "named"), [
    ({"auto_map": {"AutoModel": "McGill-NLP/LLM2Vec--modeling_llama_encoder.LlamaEncoderModel"}}, "custom code"),
    ({"is_causal": False}, "is_causal False"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"attention_bias": True}, "attention_bias true"),
    ({"mlp_bias": True}, "mlp_bias true"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}}, "type 'llama3'"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "type 'linear'"),
    ({"num_hidden_layers": 3}, "lacks"),
])
def test_what_llama_cannot_serve_exactly_is_refused_naming_it(llama_dir, tmp_path, change, named):
    path = tmp_path / "m"
    path.mkdir()
    for item in llama_dir.iterdir():
        if item.is_file():
            (path / item.name).symlink_to(item)
    (path / "config.json").unlink()
    config = json.loads((llama_dir / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError, match=named):
        Embedder.load(str(path), device="cpu")


def test_a_checkpoint_longer_than_its_window_is_served_at_a_max_seq_length_within_it(tmp_path):
    """The served length (max_seq_length) is what the window must cover: a directory whose own length passes its
    window loads once the setting brings the length within it."""
    path = checkpoints.llama(tmp_path / "m", mistral=True, sliding_window=48, max_seq_length=64)
    assert Embedder.load(str(path), device="cpu", max_seq_length=48)[0].config.max_seq_length == 48
