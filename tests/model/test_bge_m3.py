"""BGE-M3 on the CPU against FlagEmbedding's own BGEM3FlagModel on the same tiny directory (an XLM-R body, an XLM-R
SentencePiece tokenizer, colbert_linear.pt and sparse_linear.pt; tests/model/checkpoints.bge_m3): the dense vectors
(CLS, normalized), the multi-vectors (colbert_linear of every token after the first, normalized) and the sparse
weights (ReLU(sparse_linear), each token id's largest, special tokens dropped) from one model, every output the same
for an input alone as in a batch; the seam says what a model can give, and refuses what it cannot."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fusedserve.model import load
from fusedserve.model.api import InputError, LoadOptions, TextOptions
from fusedserve.model.config import UnsupportedModel
from tests.model import checkpoints
from tests.tolerances import assert_embeddings_close, assert_sparse_close

TEXTS = ["a man is eating food", "the quick brown fox jumps over the lazy dog, twice: the quick brown fox",
         "multi-vector retrieval scores by maxsim", "le chat dort", "x", "sparse weights per token id " * 12]


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return checkpoints.bge_m3(tmp_path_factory.mktemp("bge-m3"))


@pytest.fixture(scope="module")
def ours(directory):
    model = load(str(directory), LoadOptions(device="cpu", dtype="float32"))
    yield model
    model.stop()


@pytest.fixture(scope="module")
def flag(directory):
    from FlagEmbedding import BGEM3FlagModel

    reference = BGEM3FlagModel(str(directory), use_fp16=False, devices="cpu")
    return reference.encode(TEXTS, batch_size=4, max_length=128, return_dense=True, return_sparse=True,
                            return_colbert_vecs=True)


def vocabulary_rows(weights: np.ndarray, rows, vocab: int) -> np.ndarray:
    """The sparse output (per token: its weight where it holds its input's largest for its id, else zero) as rows
    over the vocabulary, checking that each input keeps at most one token per id."""
    out = np.zeros((len(rows), vocab), np.float32)
    cut = np.cumsum(rows.lengths)[:-1]
    for row, (w, ids) in enumerate(zip(np.split(weights.reshape(-1), cut), np.split(rows.ids, cut))):
        kept = ids[w > 0]
        assert len(set(kept.tolist())) == len(kept), f"input {row} keeps an id twice: {sorted(kept.tolist())}"
        out[row, kept] = w[w > 0]
    return out


def _outputs(model, texts: list[str]) -> dict[str, np.ndarray]:
    rows = model.prepare(texts, TextOptions())
    got = {output: model.launch(rows, output=output).rows() for output in ("pooled", "colbert", "sparse")}
    assert got["sparse"].shape == (rows.tokens, 1) and got["sparse"].dtype == np.float32
    got["sparse"] = vocabulary_rows(got["sparse"], rows, model.embedder.config.vocab_size)
    return got | {"lengths": np.asarray(rows.lengths)}


def test_the_three_outputs_equal_flag_embeddings(ours, flag):
    got = _outputs(ours, TEXTS)
    assert ours.describe().outputs == ("pooled", "tokens", "colbert", "sparse")
    # launch gives the raw pooled rows; the server normalizes them as each request asks (BGE-M3's modules do)
    dense = got["pooled"] / np.linalg.norm(got["pooled"], axis=1, keepdims=True)
    assert_embeddings_close(dense, flag["dense_vecs"], what="dense")
    # one multi-vector per token after each input's first, back to back
    split = np.split(got["colbert"], np.cumsum(got["lengths"] - 1)[:-1])
    assert [len(v) for v in split] == [len(v) for v in flag["colbert_vecs"]]
    for text, mine, theirs in zip(TEXTS, split, flag["colbert_vecs"]):
        assert_embeddings_close(mine, theirs, what=f"colbert vectors of {text!r}")
    # sparse: FlagEmbedding's {token id: weight} of the ids with a weight, as dense rows over the vocabulary
    want = np.zeros_like(got["sparse"])
    for row, weights in enumerate(flag["lexical_weights"]):
        for token, weight in weights.items():
            want[row, int(token)] = weight
    assert_sparse_close(got["sparse"], want, what="sparse weights")
    special = [0, 1, 2, 3]  # <s> <pad> </s> <unk>: FlagEmbedding's dropped ids
    assert not got["sparse"][:, special].any()


def test_each_output_is_the_same_alone_as_in_a_batch(ours):
    together = _outputs(ours, TEXTS)
    colbert = np.split(together["colbert"], np.cumsum(together["lengths"] - 1)[:-1])
    for i, text in enumerate(TEXTS):
        alone = _outputs(ours, [text])
        assert_embeddings_close(alone["pooled"], together["pooled"][i:i + 1], what=f"dense of {text!r}")
        assert_embeddings_close(alone["colbert"], colbert[i], what=f"colbert of {text!r}")
        assert_sparse_close(alone["sparse"], together["sparse"][i:i + 1], what=f"sparse of {text!r}")


def test_one_forward_gives_the_three_outputs(ours):
    """launch(output="m3"): the dense head's rows, the multi-vectors and the sparse weights of one forward in one
    column (model.api.split_m3), each equal to its own launch's."""
    from fusedserve.model.api import split_m3

    rows = ours.prepare(TEXTS, TextOptions())
    dense, vectors, sparse = split_m3(ours.launch(rows, output="m3").rows(), ours.describe(), rows)
    assert_embeddings_close(dense, ours.launch(rows, output="pooled").rows(), what="dense")
    assert_embeddings_close(vectors, ours.launch(rows, output="colbert").rows(), what="colbert")
    assert np.array_equal(sparse > 0, ours.launch(rows, output="sparse").rows() > 0)
    assert_sparse_close(sparse.T, ours.launch(rows, output="sparse").rows().T, what="sparse")


def test_a_model_without_the_heads_refuses_their_outputs():
    model = load("tiny", LoadOptions(device="cpu", dtype="float32"))
    try:
        assert model.describe().outputs == ("pooled", "tokens")
        rows = model.prepare(["no heads here"], TextOptions())
        for output in ("colbert", "sparse", "m3"):
            with pytest.raises(InputError, match=f"no {output} output"):
                model.launch(rows, output=output)
    finally:
        model.stop()


def test_a_half_or_foreign_head_is_refused_by_name(tmp_path):
    half = checkpoints.bge_m3(tmp_path / "half")
    (half / "sparse_linear.pt").unlink()
    with pytest.raises(UnsupportedModel, match="has only colbert_linear.pt"):
        load(str(half), LoadOptions(device="cpu", dtype="float32"))
    wrong = checkpoints.bge_m3(tmp_path / "wrong")
    torch.save({"weight": torch.zeros(1, 32), "bias": torch.zeros(1)}, wrong / "sparse_linear.pt")
    with pytest.raises(UnsupportedModel, match="sparse_linear.pt: weight .1, 32."):
        load(str(wrong), LoadOptions(device="cpu", dtype="float32"))
    pickled = checkpoints.bge_m3(tmp_path / "pickled")
    torch.save({"weight": torch.zeros(1, 64), "bias": torch.zeros(1), "extra": UnsupportedModel("code")},
               pickled / "sparse_linear.pt")  # anything but tensors: weights_only refuses it, nothing runs
    with pytest.raises(UnsupportedModel, match="sparse_linear.pt: not a Linear layer's state dict"):
        load(str(pickled), LoadOptions(device="cpu", dtype="float32"))
