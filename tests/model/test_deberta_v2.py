"""DeBERTa-v2 / v3 against the real libraries on the same directories (fp32, CPU): as an embedder against
sentence-transformers (mean pooling over DebertaV2Model) and transformers' DebertaV2Model hidden states, as a
cross-encoder against CrossEncoder and DebertaV2ForSequenceClassification's raw logits (1 label, and 3 as the NLI
models), and served on /rerank and /predict. The disentangled attention's switches each get a directory: v3's
(c2p + p2c over 256 log buckets, shared keys, the relative table LayerNorm-ed, no absolute positions), buckets and
max_relative_positions far below the inputs' lengths (the log buckets and the clamp to the table), keys of its own for
the position terms, DeBERTa-v2's absolute positions and token types, and one term alone. What the family cannot serve
exactly is refused at load, naming it."""

from __future__ import annotations

import json

import pytest
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer

from fusedserve.model.modules import activate
from fusedserve.model.packing import Packed
from fusedserve.model.config import UnsupportedModel
from fusedserve.model.runner import Embedder
from fusedserve.model.weights import CheckpointError, load_encoder
from tests.model import checkpoints
from tests.model.reference import encode_unpadded
from tests.tolerances import assert_embeddings_close, assert_scores_close

# the unigram tokenizer spells rare words out piece by piece: the last text is ~390 tokens, past v3's 256 buckets
TEXTS = ["A man is eating food.", "x", "Fused kernels make encoders fast, even for a single short request.",
         "The quick brown fox jumps over the lazy dog " * 12]
PAIRS = [("how do fused kernels help?", "They cut memory traffic between ops."), ("what is a cat", "A small feline."),
         ("q", "a much longer passage about nothing in particular " * 10), ("same", "same")]
VARIANTS = {
    "v3": {},
    # distances past max_relative_positions land beyond the table: clamped to its last rows
    "few-buckets": dict(position_buckets=16, max_relative_positions=64),
    "own-position-keys": dict(share_att_key=False),
    # DeBERTa-v2's original switches: absolute positions in the embeddings, token types, exact distances
    "v2-absolute": dict(position_biased_input=True, type_vocab_size=2, position_buckets=-1,
                        max_relative_positions=128, norm_rel_ebd="none"),
    "c2p-only": dict(pos_att_type="c2p"),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    path = checkpoints.deberta_v2(tmp_path_factory.mktemp(request.param) / "m", **VARIANTS[request.param])
    return path, SentenceTransformer(str(path), device="cpu")


@pytest.mark.parametrize(("layout", "attention"), [("packed", "auto"), ("packed", "pad"), ("padded", "auto")])
def test_embeddings_match_sentence_transformers(variant, layout, attention):
    path, reference = variant
    ours, report = Embedder.load(str(path), device="cpu", backend="torch", layout=layout, attention=attention)
    assert "architecture deberta_v2" in str(report) and "mean pooling" in str(report)
    assert len(ours.tokenize(TEXTS)[3]) > 300  # past position_buckets
    expected = encode_unpadded(reference, TEXTS)
    assert_embeddings_close(ours.embed(TEXTS), expected, what=f"{path.parent.name} {layout} {attention}")
    # batched == single
    singles = torch.cat([ours.embed([t]) for t in TEXTS])
    assert_embeddings_close(ours.embed(TEXTS), singles, what="batched against single")


@pytest.mark.parametrize("variant_name", ["v3", "few-buckets"])
def test_hidden_states_match_transformers(tmp_path, variant_name):
    """Our encoder's token states against DebertaV2Model's last_hidden_state: inputs of 1, 7, 300 and 511 tokens (the
    longest the 512 positions take), each alone and packed together, padded and packed layouts."""
    from transformers import DebertaV2Model

    path = checkpoints.deberta_v2(tmp_path / "m", **VARIANTS[variant_name])
    encoder = load_encoder(path).eval()
    theirs = DebertaV2Model.from_pretrained(str(path), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    vocab = encoder.config.vocab_size
    rows = [torch.randint(4, vocab, (n,), generator=gen).tolist() for n in (1, 7, 300, 511)]
    with torch.no_grad():
        expected = [theirs(input_ids=torch.tensor([r])).last_hidden_state[0] for r in rows]
        # transformers' own padded batch: the padding changes none of the real tokens' states
        mask = torch.tensor([[1] * len(r) + [0] * (511 - len(r)) for r in rows])
        batch = torch.tensor([r + [0] * (511 - len(r)) for r in rows])
        padded_theirs = theirs(input_ids=batch, attention_mask=mask).last_hidden_state
        padded_ours = encoder(batch, mask)
        for attention in ("pad", "varlen"):
            packed = encoder.forward_packed(Packed.from_rows(rows, "cpu"), attention)
            for i, (row, want) in enumerate(zip(rows, expected)):
                start = sum(len(r) for r in rows[:i])
                assert_embeddings_close(packed[start:start + len(row)], want, what=f"{attention}, {len(row)} tokens")
                alone = encoder.forward_packed(Packed.from_rows([row], "cpu"), attention)
                assert_embeddings_close(alone, want, what=f"{attention} alone, {len(row)} tokens")
        for i, (row, want) in enumerate(zip(rows, expected)):
            assert_embeddings_close(padded_ours[i, :len(row)], want, what=f"padded, {len(row)} tokens")
            assert_embeddings_close(padded_theirs[i, :len(row)], want, what="transformers padded against alone")


@pytest.mark.parametrize("num_labels", [1, 3])
def test_cross_encoders_match_cross_encoder_and_transformers(tmp_path, num_labels):
    from transformers import AutoTokenizer, DebertaV2ForSequenceClassification

    path = checkpoints.deberta_v2(tmp_path / "ce", num_labels=num_labels)
    ours, report = Embedder.load(str(path), device="cpu", backend="torch")
    assert ours.kind == "classifier" and "sequence classifier" in str(report)
    reference = CrossEncoder(str(path), device="cpu")
    pairs = PAIRS + [("a long query " * 20, "and a long passage past the 256 position buckets " * 8)]
    logits = ours.predict(pairs)
    raw = torch.as_tensor(reference.predict(pairs, activation_fn=torch.nn.Identity(), convert_to_numpy=True))
    assert_scores_close(logits, raw.reshape(logits.shape), logits=True, what="raw logits against CrossEncoder")
    # transformers itself, one pair at a time (no padding)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = DebertaV2ForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        direct = torch.cat([model(**tokenizer(a, b, return_tensors="pt", truncation=True)).logits for a, b in pairs])
    assert_scores_close(logits, direct, logits=True, what="raw logits against DebertaV2ForSequenceClassification")
    assert ours.tokenize_pairs(pairs) == [tokenizer(a, b, truncation=True)["input_ids"] for a, b in pairs]
    assert max(len(r) for r in ours.tokenize_pairs(pairs)) > 300
    if num_labels == 1:
        assert ours.classifier.activation == "sigmoid"
        assert_scores_close(activate(logits, "sigmoid")[:, 0], reference.predict(pairs))
    else:
        assert ours.classifier.labels == ("contradiction", "entailment", "neutral")
        assert_scores_close(activate(logits, ours.classifier.activation),
                            reference.predict(pairs, apply_softmax=True, convert_to_numpy=True))


FUSED_OPS = ("embedding_layer_norm", "linear_add_layer_norm", "linear_bias_gelu", "disentangled_attention",
             "segment_mean")


@pytest.mark.parametrize("variant_name", ["v3", "few-buckets", "own-position-keys", "c2p-only"])
def test_the_fused_kernels_serve_deberta(tmp_path, variant_name):
    """The embeddings' LayerNorm, the post-norm blocks, the disentangled attention (kernels.disentangled_attention:
    both terms from the shared keys, the log buckets past a small max_relative_positions, keys of its own for the
    terms, one term alone) and the pooling through the Triton kernels (on the interpreter here), batched and one
    input at a time (the interpreter takes minutes over a 300-token input: tests/kernels/test_disentangled_attention.py
    runs the kernel over long sequences and v3's log buckets)."""
    path = checkpoints.deberta_v2(tmp_path / "m", **VARIANTS[variant_name])
    fused, _ = Embedder.load(str(path), device="cpu", backend="triton")
    assert fused.kernel_path.selection.used == {op: "triton" for op in FUSED_OPS}
    texts = TEXTS[:3]
    expected = encode_unpadded(SentenceTransformer(str(path), device="cpu"), texts)
    assert_embeddings_close(fused.embed(texts), expected, what=f"fused {variant_name}")
    assert_embeddings_close(torch.cat([fused.embed([t]) for t in texts]), expected, what=f"fused {variant_name} single")


def test_the_fused_attention_is_the_reference_attention():
    """Layer.attend on the fused path hands the packed batch to kernels.disentangled_attention with the layer's
    projected tables, the row per distance and DeBERTa's scale, and gets what the reference path's torch attention
    (the padded block with both terms in SDPA's mask) gets (float64, the op on its reference); without position terms
    at BERT's scale it is the attention every family shares and the op is not called."""
    from dataclasses import replace

    from fusedserve import kernels
    from fusedserve.kernels import reference
    from fusedserve.model.config import EncoderConfig
    from fusedserve.model.deberta_v2 import Disentangled, Encoder

    op = "disentangled_attention"
    calls = []

    def recorded(*args, **kwargs):
        calls.append(args)
        return reference.disentangled_attention(*args, **kwargs)

    base = kernels.reference_selection("cpu", (torch.float64,))
    fused = kernels.Selection(base.device, base.dtypes, True, {**base.choices, op: replace(base.choices[op],
                                                                                            backend="triton")},
                              {**base.impls, op: recorded})
    rows = [list(range(5, 5 + n)) for n in (70, 1, 33)]
    p = Packed.from_rows(rows, "cpu")
    qkv = torch.randn(p.input_ids.shape[0], 3 * 64, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for section, called in ((Disentangled(relative_attention=True, terms=("c2p", "p2c"), span=16, buckets=16,
                                          max_relative_positions=64, share_att_key=True), True),
                            (Disentangled(relative_attention=True, terms=("c2p",), span=16, buckets=16,
                                          max_relative_positions=64), True),
                            (Disentangled(), False)):
        config = EncoderConfig(architecture="deberta_v2", hidden_size=64, num_layers=1, num_heads=4,
                               intermediate_size=128, max_position_embeddings=128, max_seq_length=128,
                               section=section)
        encoder = Encoder(config).double().eval()
        with torch.no_grad():
            if section.relative_attention:
                encoder.rel_embeddings.normal_(0, 1.0)
            for name, param in encoder.layers[0].named_parameters():  # projections of order 1 / sqrt(hidden)
                if name.startswith(("pos_", "qkv")) and name.endswith("weight"):
                    param.normal_(0, 64**-0.5)
            layer, context = encoder.layers[0], encoder.layer_context("pad")
            expected = layer.attend(qkv, p, context)
            calls.clear()
            with kernels.use(fused):
                got = layer.attend(qkv, p, context)
        assert len(calls) == called, section
        if called:
            assert calls[0][2] == p.seq and calls[0][6] is encoder.distance_rows
            assert calls[0][7] == pytest.approx((16 * (1 + len(section.terms))) ** -0.5)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def _variant_of(path, tmp_path, change: dict):
    out = tmp_path / "changed"
    out.mkdir()
    for item in path.iterdir():
        if item.is_file():
            (out / item.name).symlink_to(item)
    (out / "config.json").unlink()
    config = json.loads((path / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({k: v for k, v in {**config, **change}.items() if v is not None}))
    return out


@pytest.mark.parametrize(("change", "named"), [
    ({"conv_kernel_size": 3}, "conv_kernel_size 3 is not supported"),
    ({"embedding_size": 32}, "embedding_size 32 other than hidden_size 64"),
    ({"hidden_act": "gelu_new"}, "hidden_act 'gelu_new'"),
    ({"pos_att_type": ["p2c", "c2p", "p2p"]}, "pos_att_type \\['p2p'\\]"),
    ({"norm_rel_ebd": "layer_norm|batch_norm"}, "norm_rel_ebd 'layer_norm\\|batch_norm'"),
    ({"attention_head_size": 8}, "attention_head_size 8"),
    ({"position_biased_input": True}, "lacks 1 tensors"),  # the config asks for a position table the file lacks
])
def test_what_deberta_cannot_serve_exactly_is_refused_naming_it(tmp_path, change, named):
    path = checkpoints.deberta_v2(tmp_path / "m")
    with pytest.raises(CheckpointError, match=named):
        Embedder.load(str(_variant_of(path, tmp_path, change)), device="cpu")


def test_a_classifier_pooler_activation_other_than_gelu_is_refused(tmp_path):
    path = checkpoints.deberta_v2(tmp_path / "ce", num_labels=1)
    with pytest.raises(CheckpointError, match="pooler_hidden_act 'tanh'"):
        Embedder.load(str(_variant_of(path, tmp_path, {"pooler_hidden_act": "tanh"})), device="cpu")


def test_served_on_rerank_and_predict(tmp_path):
    """A reranker on TEI's /rerank and an NLI model on /predict, through the real server: the scores CrossEncoder
    gives (sigmoid of the one logit; softmax over the three labels), raw_scores the logits."""
    import httpx

    from tests.server.conftest import start_server

    query, documents = PAIRS[0][0], [d for _, d in PAIRS]
    reranker = checkpoints.deberta_v2(tmp_path / "reranker", num_labels=1)
    expected = CrossEncoder(str(reranker), device="cpu").predict([(query, d) for d in documents])
    server = start_server(tmp_path, model=str(reranker), device="cpu", warmup=False, kernel_timing_sample_rate=0)
    try:
        ranked = httpx.post(server.url + "/rerank", json={"query": query, "texts": documents}, timeout=60)
    finally:
        server.stop()
    assert ranked.status_code == 200, ranked.text
    assert [x["index"] for x in ranked.json()] == sorted(range(len(documents)), key=lambda i: -float(expected[i]))
    assert_scores_close([x["score"] for x in ranked.json()], [float(expected[x["index"]]) for x in ranked.json()])

    nli = checkpoints.deberta_v2(tmp_path / "nli", num_labels=3)
    reference = CrossEncoder(str(nli), device="cpu")
    probabilities = reference.predict(PAIRS, apply_softmax=True, convert_to_numpy=True)
    logits = reference.predict(PAIRS, activation_fn=torch.nn.Identity(), convert_to_numpy=True)
    server = start_server(tmp_path, model=str(nli), device="cpu", warmup=False, kernel_timing_sample_rate=0)
    try:
        predicted = httpx.post(server.url + "/predict", json={"inputs": [list(p) for p in PAIRS]}, timeout=60)
        raw = httpx.post(server.url + "/predict", json={"inputs": [list(p) for p in PAIRS], "raw_scores": True},
                         timeout=60)
    finally:
        server.stop()
    assert predicted.status_code == raw.status_code == 200, (predicted.text, raw.text)
    labels = ("contradiction", "entailment", "neutral")
    for got, want, are_logits in ((predicted.json(), probabilities, False), (raw.json(), logits, True)):
        by_label = [[next(x["score"] for x in row if x["label"] == label) for label in labels] for row in got]
        assert_scores_close(by_label, want, logits=are_logits)


def test_a_checkpoint_with_only_spm_model_is_refused_by_name(tmp_path):
    """Many DeBERTa-v3 checkpoints ship spm.model alone: the load says so and how to write tokenizer.json."""
    path = checkpoints.deberta_v2(tmp_path / "m")
    (path / "tokenizer.json").unlink()
    (path / "spm.model").write_bytes(b"\x0a\x00")
    with pytest.raises(UnsupportedModel, match="spm.model without tokenizer.json: .*save_pretrained"):
        Embedder.load(str(path), device="cpu")
