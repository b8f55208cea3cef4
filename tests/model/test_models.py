"""The models users bring, against the real libraries on the same directories (fp32, CPU): sentence-transformers'
SentenceTransformer for embedding models (pooling modes, Dense, Normalize, prompts; BERT, XLM-RoBERTa, DistilBERT)
and CrossEncoder for classifiers (1 and 3 labels; BERT, XLM-RoBERTa, DistilBERT heads). What cannot be served
exactly is refused at load, naming it."""

from __future__ import annotations

import json

import pytest
import torch

from sentence_transformers import CrossEncoder, SentenceTransformer

from fusedserve.model.config import UnsupportedModel
from fusedserve.model.modules import activate
from fusedserve.model.runner import Embedder
from fusedserve.model.weights import CheckpointError
from tests.model import checkpoints
from tests.model.reference import encode_unpadded
from tests.tolerances import assert_embeddings_close, score_tolerance, tolerance


TEXTS = ["A man is eating food.", "Fused kernels make encoders fast, even for a single short request.", "x",
         "The quick brown fox jumps over the lazy dog " * 12]
PAIRS = [("how do fused kernels help?", "They cut memory traffic between ops."), ("what is a cat", "A small feline."),
         ("q", "a much longer passage about nothing in particular " * 10), ("same", "same")]
# fp32 on the CPU against the reference library on the same weights: the tables' float32 entries
MIN_COSINE, MAX_SCORE_ERROR = tolerance(torch.float32).min_cosine, score_tolerance(torch.float32)


def _agree(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    cosine = torch.nn.functional.cosine_similarity(ours.double(), theirs.double(), dim=1)
    assert float(cosine.min()) >= MIN_COSINE, cosine


def _reference(path) -> SentenceTransformer:
    return SentenceTransformer(str(path), device="cpu")


@pytest.mark.parametrize("pooling", [["cls"], ["max"], ["mean_sqrt_len_tokens"], ["lasttoken"], ["cls", "mean"]])
def test_minilm_repooled_matches_sentence_transformers(tmp_path, pooling):
    path = checkpoints.minilm(tmp_path / "m", pooling)
    ours, report = Embedder.load(str(path), device="cpu", backend="torch")
    assert " + ".join(pooling) + " pooling" in str(report)
    _agree(ours.embed(TEXTS), _reference(path).encode(TEXTS, convert_to_tensor=True))


def test_minilm_with_dense_modules_matches_sentence_transformers(tmp_path):
    path = checkpoints.minilm(tmp_path / "m", ["mean"], dense=[(384, 128, "tanh"), (128, 64, "identity")])
    ours, _ = Embedder.load(str(path), device="cpu", backend="torch")
    assert ours.dim == 64
    _agree(ours.embed(TEXTS), _reference(path).encode(TEXTS, convert_to_tensor=True))


@pytest.mark.parametrize("build", [checkpoints.tiny_xlm_roberta, checkpoints.tiny_distilbert, checkpoints.mpnet,
                                   checkpoints.gte, checkpoints.nomic_bert, checkpoints.modernbert],
                         ids=["xlm-roberta", "distilbert", "mpnet", "gte", "nomic_bert", "modernbert"])
@pytest.mark.parametrize("pooling", [["mean"], ["cls"]])
def test_other_architectures_match_sentence_transformers(tmp_path, build, pooling):
    path = build(tmp_path / "m", pooling)
    ours, report = Embedder.load(str(path), device="cpu", backend="torch")
    assert ours.config.architecture in ("roberta", "distilbert", "mpnet", "gte", "nomic_bert", "modernbert")
    assert ours.config.architecture in str(report)
    _agree(ours.embed(TEXTS), _reference(path).encode(TEXTS, convert_to_tensor=True))


@pytest.mark.parametrize("build", [checkpoints.tiny_xlm_roberta, checkpoints.mpnet, checkpoints.gte,
                                   checkpoints.nomic_bert, checkpoints.modernbert],
                         ids=["xlm-roberta", "mpnet", "gte", "nomic_bert", "modernbert"])
def test_the_fused_kernels_serve_other_architectures(tmp_path, build):
    """XLM-R's offset positions and single token type, MPNet's relative position bias, GTE's rotary embeddings and
    gated GELU, NomicBERT's SwiGLU without biases, ModernBERT's pre-norm blocks and sliding-window layers, through
    the Triton kernels (on the interpreter here)."""
    path = build(tmp_path / "m")
    fused, _ = Embedder.load(str(path), device="cpu", backend="triton")
    assert set(fused.kernel_path.selection.used.values()) == {"triton"}
    _agree(fused.embed(TEXTS[:3]), _reference(path).encode(TEXTS[:3], convert_to_tensor=True))


def test_prompts_count_toward_truncation_as_sentence_transformers_counts_them(tmp_path):
    prompts = {"query": "Represent this query for retrieving passages: ", "doc": ""}
    path = checkpoints.minilm(tmp_path / "m", ["mean"], prompts=prompts, default_prompt="query")
    ours, _ = Embedder.load(str(path), device="cpu", backend="torch")
    reference = _reference(path)
    for name in ("query", "doc", None):
        _agree(ours.embed(TEXTS, prompt_name=name), reference.encode(TEXTS, prompt_name=name, convert_to_tensor=True))
    long = ["word " * 400]  # truncated at 256 tokens, the prompt's included
    assert len(ours.tokenize(long, prompt_name="query")[0]) == 256
    assert ours.tokenize(long, prompt_name="query")[0][1:5] != ours.tokenize(long, prompt_name="doc")[0][1:5]
    with pytest.raises(ValueError, match="prompt_name 'passage' is not one of this model's prompts"):
        ours.embed(TEXTS, prompt_name="passage")


@pytest.mark.slow
def test_base_shape_mpnet_matches_sentence_transformers(tmp_path):
    """all-mpnet-base-v2's shape (12 heads of 64) on a long input: the relative bias reaches its log-spaced buckets
    (distances past 8) and saturates (past 128) only in sequences this long."""
    path = checkpoints.mpnet(tmp_path / "m", shape="base")
    ours, _ = Embedder.load(str(path), device="cpu", backend="torch")
    texts = [TEXTS[1], "x", "relative positions reach far in long inputs " * 60]
    _agree(ours.embed(texts), encode_unpadded(_reference(path), texts))


@pytest.mark.slow
@pytest.mark.parametrize("build", [checkpoints.nomic_bert, checkpoints.modernbert], ids=["nomic_bert", "modernbert"])
def test_base_shape_rotary_families_match_sentence_transformers(tmp_path, build):
    """nomic-embed-text-v1.5's and ModernBERT-base's shapes on a long input (past ModernBERT's 128-token local
    window, so its sliding-window layers drop keys)."""
    path = build(tmp_path / "m", shape="base")
    ours, _ = Embedder.load(str(path), device="cpu", backend="torch")
    texts = [TEXTS[1], "x", "rotary angles and local windows matter in long inputs " * 40]
    _agree(ours.embed(texts), encode_unpadded(_reference(path), texts))


@pytest.mark.slow
def test_gte_at_both_shapes_matches_the_reference_the_gpu_tests_carry(tmp_path):
    """GTE tiny and at gte-multilingual-base's shape against sentence-transformers, and the embeddings the GPU
    tests carry (the H200 image's transformers has no GTE): rebuilt here from the same seed, the same weight bytes
    and the same vectors, so the carried file cannot go stale."""
    carried = json.loads(checkpoints.GTE_REFERENCE.read_text())
    fresh = checkpoints.gte_reference(tmp_path)
    assert carried["texts"] == fresh["texts"]
    for shape, entry in fresh["shapes"].items():
        assert carried["shapes"][shape]["digest"] == entry["digest"], f"{shape}: the seeded weights changed"
        theirs = torch.tensor(entry["embeddings"])
        assert_embeddings_close(carried["shapes"][shape]["embeddings"], theirs, what=f"{shape}: the carried reference")
        ours, _ = Embedder.load(str(tmp_path / shape), device="cpu", backend="torch")
        _agree(ours.embed(fresh["texts"]), theirs)


def test_gte_reads_the_hub_layout_and_transformers_own(tmp_path):
    """GTE checkpoints ship fused (qkv_proj, up_gate_proj with the up rows first, encoder.layer.{i}: the released
    models' custom-code layout, which transformers also saves); transformers' GteModel names them apart. Both load
    to the same encoder, and a checkpoint whose config asks for math the family does not do is refused by name."""
    hub = checkpoints.gte(tmp_path / "hub", layout="hub")
    native = checkpoints.gte(tmp_path / "native", layout="transformers")
    from safetensors import safe_open

    with safe_open(hub / "model.safetensors", "pt") as f:
        assert any("up_gate_proj" in k for k in f.keys())
    with safe_open(native / "model.safetensors", "pt") as f:
        assert any("mlp.gate_proj" in k for k in f.keys())
    a, _ = Embedder.load(str(hub), device="cpu", backend="torch")
    b, _ = Embedder.load(str(native), device="cpu", backend="torch")
    assert torch.equal(a.embed(TEXTS), b.embed(TEXTS))
    _agree(b.embed(TEXTS), _reference(native).encode(TEXTS, convert_to_tensor=True))
    config = json.loads((hub / "config.json").read_text())
    # the released checkpoints' config: custom code (auto_map), model_type "new", its own names for the same math
    released = {k: v for k, v in config.items() if k not in ("rope_parameters", "architectures", "model_type")}
    released.update(model_type="new", architectures=["NewModel"], rope_theta=160000.0, rope_scaling=None,
                    position_embedding_type="rope", layer_norm_type="layer_norm", logn_attention_scale=False,
                    pack_qkv=True, auto_map={"AutoConfig": "Alibaba-NLP/new-impl--configuration.NewConfig",
                                             "AutoModel": "Alibaba-NLP/new-impl--modeling.NewModel"})
    (hub / "config.json").write_text(json.dumps(released))
    c, _ = Embedder.load(str(hub), device="cpu", backend="torch")
    assert torch.equal(c.embed(TEXTS), b.embed(TEXTS))
    for change, named in (({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
                           "rotary embeddings of type 'dynamic'"), ({"hidden_act": "relu"}, "hidden_act 'relu'"),
                          ({"model_type": "new", "rope_scaling": {"type": "ntk", "factor": 2.0}}, "'ntk'"),
                          ({"model_type": "new", "logn_attention_scale": True}, "logn_attention_scale True"),
                          ({"model_type": "new", "layer_norm_type": "rms_norm"}, "layer_norm_type 'rms_norm'")):
        (hub / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(CheckpointError, match=named):
            Embedder.load(str(hub), device="cpu")


def test_nomic_bert_reads_the_released_layout_and_transformers_own(tmp_path):
    """NomicBERT checkpoints ship in Nomic's layout and config (GPT-2 style keys, auto_map, a fused Wqkv, fc11 = up,
    fc12 = gate); transformers' NomicBertModel names them apart. All three directories load to the same encoder,
    and the custom code's switches that change the math are refused by name."""
    released = checkpoints.nomic_bert(tmp_path / "released", layout="released")
    native = checkpoints.nomic_bert(tmp_path / "native", layout="transformers")
    hub = checkpoints.nomic_bert(tmp_path / "hub")
    from safetensors import safe_open

    with safe_open(released / "model.safetensors", "pt") as f:
        assert any("attn.Wqkv" in k for k in f.keys()) and any("mlp.fc12" in k for k in f.keys())
    ours = [Embedder.load(str(p), device="cpu", backend="torch")[0].embed(TEXTS) for p in (released, native, hub)]
    assert torch.equal(ours[0], ours[1]) and torch.equal(ours[1], ours[2])
    _agree(ours[1], _reference(native).encode(TEXTS, convert_to_tensor=True))
    config = json.loads((released / "config.json").read_text())
    for change, named in (({"prenorm": True}, "prenorm True"), ({"rotary_emb_fraction": 0.5}, "rotary_emb_fraction"),
                          ({"qkv_proj_bias": True}, "qkv_proj_bias True"), ({"causal": True}, "causal True"),
                          ({"rotary_scaling_factor": 2.0}, "rotary_scaling_factor 2.0"),
                          ({"mlp_fc1_bias": None}, "mlp_fc1_bias True"),  # absent: the custom code's default
                          ({"activation_function": "relu"}, "hidden_act 'relu'")):
        changed = {**config, **change}
        changed = {k: v for k, v in changed.items() if v is not None or k == "rotary_scaling_factor"}
        (released / "config.json").write_text(json.dumps(changed))
        with pytest.raises(CheckpointError, match=named):
            Embedder.load(str(released), device="cpu")


def test_modernbert_refuses_what_it_cannot_serve_exactly(tmp_path):
    ce = checkpoints.cross_encoder(tmp_path / "ce", 1, "modernbert")
    config = json.loads((ce / "config.json").read_text())
    for change, named in (({"classifier_activation": "silu"}, "classifier_activation 'silu'"),
                          ({"classifier_pooling": "max"}, "classifier_pooling 'max'")):
        (ce / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(UnsupportedModel, match=named):
            Embedder.load(str(ce), device="cpu")
    path = checkpoints.modernbert(tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    for change, named in (({"hidden_activation": "silu"}, "hidden_activation 'silu'"),
                          ({"attention_bias": True}, "attention_bias True with mlp_bias False"),
                          ({"rope_parameters": {**config["rope_parameters"], "full_attention": {
                              "rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}}, "type 'yarn'"),
                          ({"layer_types": ["chunked_attention"] * 4}, "layer_types"),
                          ({"norm_bias": True}, "lacks 9 tensors")):  # the config asks for norm biases the file lacks
        (path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(CheckpointError, match=named):
            Embedder.load(str(path), device="cpu")


@pytest.mark.parametrize("architecture", ["bert", "roberta", "distilbert", "mpnet", "gte", "modernbert"])
@pytest.mark.parametrize("num_labels", [1, 3])
def test_classifiers_match_cross_encoder(tmp_path, architecture, num_labels):
    path = checkpoints.cross_encoder(tmp_path / "ce", num_labels, architecture)
    ours, report = Embedder.load(str(path), device="cpu", backend="torch")
    assert ours.kind == "classifier" and "sequence classifier" in str(report)
    reference = CrossEncoder(str(path), device="cpu")
    logits = ours.predict(PAIRS)
    scores = activate(logits, ours.classifier.activation)
    if num_labels == 1:
        expected = torch.as_tensor(reference.predict(PAIRS, convert_to_numpy=True)).reshape(-1, 1)
        assert ours.classifier.activation == "sigmoid"
        ranked = reference.rank(PAIRS[0][0], [b for _, b in PAIRS])
        ours_ranked = activate(ours.predict([(PAIRS[0][0], b) for _, b in PAIRS]), "sigmoid")[:, 0]
        assert [r["corpus_id"] for r in ranked] == torch.argsort(ours_ranked, descending=True).tolist()
    else:
        expected = torch.as_tensor(reference.predict(PAIRS, apply_softmax=True, convert_to_numpy=True))
        assert ours.classifier.labels == ("contradiction", "entailment", "neutral")
    assert float((scores - expected).abs().max()) <= MAX_SCORE_ERROR, (scores, expected)
    raw = torch.as_tensor(reference.predict(PAIRS, activation_fn=torch.nn.Identity(), convert_to_numpy=True))
    raw = raw.reshape(logits.shape)  # logits are not bounded like scores: the same bound relative to their size
    assert float((logits - raw).abs().max()) <= MAX_SCORE_ERROR * max(1.0, float(raw.abs().max()))


def test_classifier_pairs_carry_token_types_and_truncate_longest_first(tmp_path):
    path = checkpoints.cross_encoder(tmp_path / "ce", 1)
    ours, _ = Embedder.load(str(path), device="cpu", backend="torch", max_seq_length=32)
    reference = CrossEncoder(str(path), device="cpu", max_length=32)
    long_pairs = [("a question " * 30, "a short answer"), ("short", "a passage " * 40),
                  ("what is [SEP] here", "an answer with a [SEP] inside")]  # literal separators: types by position
    ids = ours.tokenize_pairs(long_pairs)
    assert all(len(row) == 32 for row in ids[:2])
    encoded = reference.tokenizer([a for a, _ in long_pairs], [b for _, b in long_pairs], truncation=True,
                                  max_length=32)
    assert ids == encoded["input_ids"]
    assert [[int(i >= row.second) for i in range(len(row))] for row in ids] == encoded["token_type_ids"]
    scores = activate(ours.predict(long_pairs), "sigmoid")[:, 0]
    assert float((scores - torch.as_tensor(reference.predict(long_pairs))).abs().max()) <= MAX_SCORE_ERROR


def test_plain_hugging_face_directories_are_mean_pooled_unless_pooling_says(tmp_path):
    path = checkpoints.tiny_distilbert(tmp_path / "m")
    for name in ("modules.json", "config_sentence_transformers.json", "sentence_bert_config.json"):
        (path / name).unlink()
    ours, report = Embedder.load(str(path), device="cpu", backend="torch")
    assert "plain Hugging Face directory: mean pooling" in str(report)
    reference = _reference(path)  # sentence-transformers' own default for such a directory: mean pooling
    _agree(ours.embed(TEXTS, normalize=False), reference.encode(TEXTS, convert_to_tensor=True))
    cls, report = Embedder.load(str(path), device="cpu", backend="torch", pooling="cls")
    assert "cls pooling (POOLING setting)" in str(report)
    assert not torch.allclose(cls.embed(TEXTS), ours.embed(TEXTS))


def test_what_cannot_be_served_exactly_is_refused_naming_it(tmp_path):
    path = checkpoints.minilm(tmp_path / "weighted", ["mean"])
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"embedding_dimension": 384,
                                                                "pooling_mode": "weightedmean"}))
    with pytest.raises(UnsupportedModel, match="pooling mode 'weightedmean' is not supported"):
        Embedder.load(str(path), device="cpu")
    path = checkpoints.minilm(tmp_path / "module", ["mean"])
    modules = json.loads((path / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_LayerNorm", "type": "sentence_transformers.models.LayerNorm"})
    (path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UnsupportedModel, match="module 'sentence_transformers.models.LayerNorm' is not supported"):
        Embedder.load(str(path), device="cpu")
    path = checkpoints.minilm(tmp_path / "electra", ["mean"])
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "electra",
                                                  "architectures": ["ElectraModel"]}))
    with pytest.raises(CheckpointError, match="model_type 'electra' \\(ElectraModel\\) is not supported; "
                                              "supported model types: bert, roberta, xlm-roberta, distilbert, mpnet, gte, new, "
                                              "nomic_bert, modernbert, qwen3, qwen2"):
        Embedder.load(str(path), device="cpu")
    ce = checkpoints.cross_encoder(tmp_path / "ce", 1)
    with pytest.raises(UnsupportedModel, match="is a classifier"):
        Embedder.load(str(ce), device="cpu", pooling="cls")
