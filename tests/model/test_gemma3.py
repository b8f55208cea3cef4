"""EmbeddingGemma (Gemma3TextModel with use_bidirectional_attention) against sentence-transformers and against
transformers' Gemma3TextModel on the same directories (fp32, CPU): bidirectional grouped-query attention, global and
sliding-window layers with their own rotary bases, a window of 8 (keys at most 4 positions away) that the inputs here
outgrow, query_pre_attn_scalar apart from the head width, the scaled embedding, Gemma's (1 + w) RMSNorms, the tanh-GELU
gate, mean pooling, two Dense modules without bias and Normalize, the query / document prompts; float16 refused by
name; what the family cannot serve exactly refused at load, naming it."""

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
         "Bidirectional attention through a sliding window reads each token's neighbours on both sides. " * 4]
PROMPTS = (None, "query", "document")
MIN_COSINE = tolerance(torch.float32).min_cosine
WINDOW = 8  # config.json's sliding_window: keys at most WINDOW // 2 positions away


def _agree(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    cosine = torch.nn.functional.cosine_similarity(ours.double(), theirs.double(), dim=1)
    assert float(cosine.min()) >= MIN_COSINE, cosine


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return checkpoints.gemma3(tmp_path_factory.mktemp("gemma3") / "m", sliding_window=WINDOW)


@pytest.fixture(scope="module")
def reference(gemma_dir):
    return SentenceTransformer(str(gemma_dir), device="cpu")


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_embeddinggemma_matches_sentence_transformers(gemma_dir, reference, layout):
    ours, report = Embedder.load(str(gemma_dir), device="cpu", backend="torch", layout=layout)
    assert "architecture gemma3" in str(report) and ours.dim == 48  # the second Dense module's width
    for prompt in PROMPTS:
        embedded = ours.embed(TEXTS, prompt_name=prompt)
        _agree(embedded, encode_unpadded(reference, TEXTS, prompt_name=prompt))
        _agree(torch.cat([ours.embed([t], prompt_name=prompt) for t in TEXTS]), embedded)  # batched == alone
        rows = ours.tokenize(TEXTS, prompt_name=prompt)
        prompted = [reference.prompts[prompt] + t for t in TEXTS] if prompt else TEXTS
        assert rows == [reference.tokenize([t])["input_ids"][0].tolist() for t in prompted]
    # with the document prompt every input is longer than the window: its sliding-window layers see part of it
    assert all(len(r) > 2 * (WINDOW // 2) + 1 for r in rows)


def test_embeddinggemma_matches_transformers_hidden_states(gemma_dir, tmp_path):
    """The encoder alone (the directory's transformers files: a plain Hugging Face directory, mean-pooled) against
    Gemma3TextModel's final hidden states of each input alone, a prompt before it, averaged over its tokens."""
    from transformers import AutoModel

    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (plain / name).symlink_to(gemma_dir / name)
    ours, report = Embedder.load(str(plain), device="cpu", backend="torch")
    assert "mean pooling" in str(report) and ours.dim == 64
    model = AutoModel.from_pretrained(str(plain), dtype=torch.float32).eval()
    assert type(model).__name__ == "Gemma3TextModel" and model.config.use_bidirectional_attention
    texts = [checkpoints.EMBEDDINGGEMMA_PROMPTS["query"] + t for t in TEXTS]
    rows = ours.tokenize(texts)
    with torch.no_grad():
        theirs = torch.stack([model(torch.tensor([row])).last_hidden_state[0].mean(0) for row in rows])
    _agree(ours.embed(texts), torch.nn.functional.normalize(theirs, dim=1))


def test_the_window_changes_what_a_long_input_sees(gemma_dir, tmp_path):
    """The same weights with a window wider than every input (the sliding layers then see every key) give another
    embedding for the long inputs and the same for an input inside the window: the window is applied, and as
    transformers applies it."""
    wide = tmp_path / "wide"
    wide.mkdir()
    for item in gemma_dir.iterdir():
        (wide / item.name).symlink_to(item)
    (wide / "config.json").unlink()
    config = json.loads((gemma_dir / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "sliding_window": 1024}))
    narrow, _ = Embedder.load(str(gemma_dir), device="cpu", backend="torch")
    full, _ = Embedder.load(str(wide), device="cpu", backend="torch")
    texts = ["x", TEXTS[3]]
    a, b = narrow.embed(texts), full.embed(texts)
    _agree(a[:1], b[:1])
    # the window changes the long text's embedding: by more than the float32 table lets the same model differ
    assert float(torch.nn.functional.cosine_similarity(a[1:], b[1:]).min()) < MIN_COSINE
    _agree(b, encode_unpadded(SentenceTransformer(str(wide), device="cpu"), texts))


def test_the_fused_kernel_serves_gemma3(gemma_dir, reference):
    """The attention (bidirectional, windowed, grouped-query) and the mean pooling on the Triton kernels (the
    interpreter here)."""
    fused, report = Embedder.load(str(gemma_dir), device="cpu", backend="triton")
    assert report.kernels.used == {"rotary_attention": "triton", "segment_mean": "triton"}
    _agree(fused.embed(TEXTS[:3], prompt_name="query"), encode_unpadded(reference, TEXTS[:3], prompt_name="query"))


def test_bfloat16_is_the_default_on_a_gpu_and_float16_is_refused_by_name(gemma_dir):
    from fusedserve.model.families import config_from_dir, family

    config = config_from_dir(gemma_dir)
    assert family(config).dtype_on_cuda == torch.bfloat16
    encoder = family(config).encoder(config)
    assert encoder.to(torch.bfloat16).final_ln_weight.dtype == torch.bfloat16
    with pytest.raises(UnsupportedModel, match="dtype float16 is not supported by EmbeddingGemma"):
        encoder.to(torch.float16)
    with pytest.raises(UnsupportedModel, match="dtype float16 is not supported by EmbeddingGemma"):
        family(config).encoder(config).half()


def test_the_config_read_from_a_transformers_4_config_json():
    """embeddinggemma-300m's config.json (transformers 4's): rope_theta and rope_local_base_freq at the top level,
    rope_scaling null, sliding_window 512 (keys at most 256 away)."""
    from fusedserve.model.families import config_from_hf
    from fusedserve.model.gemma3 import Gemma3Attention

    hf = {"model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 768, "intermediate_size": 1152,
          "num_hidden_layers": 24, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 256,
          "max_position_embeddings": 2048, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "rope_scaling": None,
          "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "sliding_window": 512,
          "attn_logit_softcapping": None, "final_logit_softcapping": None, "use_bidirectional_attention": True,
          "hidden_activation": "gelu_pytorch_tanh", "pad_token_id": 0,
          "layer_types": ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(24)]}
    config = config_from_hf(hf)
    assert (config.rope_theta, config.local_rope_theta, config.sliding_window) == (1e6, 1e4, 256)
    assert config.sliding_layers == tuple(i for i in range(24) if (i + 1) % 6)
    assert config.section == Gemma3Attention(256.0) and config.kv_heads == 1 and config.head_dim == 256


@pytest.mark.parametrize(("change", "named"), [
    ({"use_bidirectional_attention": False}, "use_bidirectional_attention False"),
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ({"attention_bias": True}, "attention_bias true"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0"),
    ({"auto_map": {"AutoModel": "someone/modeling_gemma.Model"}}, "custom code"),
    ({"sliding_window": None}, "sliding_window None is not supported"),
    ({"sliding_window": 1}, "sliding_window 1 is not supported"),
    ({"rope_parameters": {"full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "type 'linear'"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "sliding_attention", "sliding_attention"]},
     "layer_types"),
    ({"num_hidden_layers": 3, "layer_types": ["full_attention"] * 3}, "more layers than num_layers=3"),
])
def test_what_gemma3_cannot_serve_exactly_is_refused_naming_it(gemma_dir, tmp_path, change, named):
    path = tmp_path / "m"
    path.mkdir()
    for item in gemma_dir.iterdir():
        (path / item.name).symlink_to(item)
    (path / "config.json").unlink()
    config = json.loads((gemma_dir / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError, match=named):
        Embedder.load(str(path), device="cpu")
