"""ColBERT models in PyLate's layout on the CPU in float32, against PyLate's own outputs on the same tiny directories
(tests/model/golden/pylate.json, written by tests/model/pylate_golden.py from checkpoints.colbert): the prepared
input ids of queries and documents, one normalized vector per kept token, MaxSim scores and PyLate's rerank order,
for BERT and ModernBERT bodies, expansion tokens attended or not, queries not expanded; every text the same alone as
in a batch of queries and documents together; the text side as data; and what a ColBERT model refuses."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fusedserve.model import load, text_side
from fusedserve.model.api import (Description, InputError, InputTooLong, InvalidInput, LoadOptions, Rows, TextOptions,
                                  TextSpec, multi_vector_counts)
from fusedserve.model.config import UnsupportedModel
from tests.model import checkpoints
from tests.tolerances import assert_embeddings_close, assert_scores_close, assert_unit_length, score_tolerance

GOLDEN = json.loads((Path(__file__).resolve().parent / "golden" / "pylate.json").read_text())
VARIANTS = list(GOLDEN["variants"])
ROLES = {"queries": "query", "documents": "document"}


@pytest.fixture(scope="module")
def directories(tmp_path_factory):
    root = tmp_path_factory.mktemp("colbert")
    return {name: checkpoints.colbert(root / name, **variant["builder"])
            for name, variant in GOLDEN["variants"].items()}


@pytest.fixture(scope="module")
def models(directories):
    loaded = {name: load(str(path), LoadOptions(device="cpu", dtype="float32")) for name, path in directories.items()}
    yield loaded
    for model in loaded.values():
        model.stop()


def _vectors(model, rows: Rows) -> list[np.ndarray]:
    """launch(output="colbert")'s block split per row by multi_vector_counts (the server's split)."""
    block = model.launch(rows, output="colbert").rows()
    counts = multi_vector_counts(model.describe(), rows)
    assert block.dtype == np.float32 and block.shape == (counts.sum(), model.describe().dim)
    return np.split(block, np.cumsum(counts)[:-1])


def _encode(model, texts: list[str], role: str) -> list[np.ndarray]:
    return _vectors(model, model.prepare(texts, TextOptions(prompt_name=role)))


def _maxsim(query: np.ndarray, document: np.ndarray, rows: int | None = None) -> float:
    """sum over the query's vectors of the largest dot product with the document's; rows: PyLate's rerank pads the
    document with zero vectors to that many rows, whose dot product 0 takes part in the max."""
    similarities = query.astype(np.float64) @ document.astype(np.float64).T
    best = similarities.max(axis=1)
    if rows is not None and rows > len(document):
        best = np.maximum(best, 0.0)
    return float(best.sum())


def test_the_builder_makes_the_directories_pylate_read(directories):
    for name, path in directories.items():
        assert checkpoints.colbert_digests(path) == GOLDEN["variants"][name]["digests"], name


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_model_reads_what_pylate_read(models, variant):
    read, model = GOLDEN["variants"][variant]["read"], models[variant]
    colbert = model.describe().text.colbert
    assert (colbert.query_marker, colbert.document_marker, colbert.mask_id) == \
        (read["query_prefix_id"], read["document_prefix_id"], read["pad_token_id"])
    assert (colbert.query_length, colbert.document_length, colbert.expansion, colbert.attend_expansion) == \
        (read["query_length"], read["document_length"], read["do_query_expansion"], read["attend_to_expansion_tokens"])
    assert colbert.skiplist == tuple(sorted(read["skiplist_ids"]))
    described = model.describe()
    assert described.kind == "embedding" and described.outputs == ("tokens", "colbert") and described.dim == 24


@pytest.mark.parametrize("variant", VARIANTS)
def test_prepared_ids_equal_pylate(models, variant):
    model, golden = models[variant], GOLDEN["variants"][variant]
    for key, role in ROLES.items():
        want = [text["input_ids"] for text in golden[key]]
        assert model.prepare(GOLDEN[key], TextOptions(prompt_name=role)).tolist() == want, (variant, role)
    # PyLate's encode prepares queries unless told otherwise
    assert model.prepare(GOLDEN["queries"], TextOptions()).tolist() == [t["input_ids"] for t in golden["queries"]]


@pytest.mark.parametrize("variant", VARIANTS)
def test_vectors_equal_pylate(models, variant):
    model, golden = models[variant], GOLDEN["variants"][variant]
    for key, role in ROLES.items():
        for text, mine, theirs in zip(GOLDEN[key], _encode(model, GOLDEN[key], role), golden[key]):
            assert len(mine) == len(theirs["kept"]) == len(theirs["vectors"]), (variant, role, text)
            assert_embeddings_close(mine, theirs["vectors"], what=f"{variant} {role} {text!r}")
            assert_unit_length(mine)


@pytest.mark.parametrize("variant", VARIANTS)
def test_maxsim_scores_and_rerank_order_equal_pylate(models, variant):
    model, golden = models[variant], GOLDEN["variants"][variant]
    queries = _encode(model, GOLDEN["queries"], "query")
    documents = _encode(model, GOLDEN["documents"], "document")
    scores = [[_maxsim(q, d) for d in documents] for q in queries]
    assert_scores_close(scores, golden["scores_unpadded"], what=f"{variant} MaxSim")
    # PyLate's own score matrix pads every document to the longest (a negative best similarity counts 0 there)
    longest = max(len(d) for d in documents)
    padded = [[_maxsim(q, d, longest) for d in documents] for q in queries]
    assert_scores_close(padded, golden["scores"], what=f"{variant} colbert_scores")
    tolerance = score_tolerance()
    ids = GOLDEN["documents_ids"]
    for query, candidates, ranked in zip(queries, GOLDEN["candidates"], golden["rerank"]):
        longest = max(len(documents[i]) for i in candidates)  # rerank pads each query's candidates
        mine = {ids[i]: _maxsim(query, documents[i], longest) for i in candidates}
        assert_scores_close([mine[r["id"]] for r in ranked], [r["score"] for r in ranked],
                            what=f"{variant} rerank scores")
        # PyLate's order, best first; two documents whose scores are within the tolerance may come either way
        for i, first in enumerate(ranked):
            for second in ranked[i + 1:]:
                if first["score"] - second["score"] > tolerance:
                    assert mine[first["id"]] > mine[second["id"]], (variant, first, second)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_text_alone_equals_it_in_a_batch_of_queries_and_documents(models, variant):
    model = models[variant]
    queries = model.prepare(GOLDEN["queries"], TextOptions(prompt_name="query"))
    documents = model.prepare(GOLDEN["documents"], TextOptions(prompt_name="document"))
    # interleaved, as the batcher gathers several requests' rows
    picks = [(rows, i) for i in range(max(len(queries), len(documents)))
             for rows in (documents, queries) if i < len(rows)]
    together = _vectors(model, Rows.gather(picks))
    for (rows, i), vectors in zip(picks, together):
        alone = _vectors(model, Rows.gather([(rows, i)]))[0]
        assert_embeddings_close(vectors, alone, what=f"{variant} row {rows.tolist()[i]}")
    tokens = model.launch(Rows.gather(picks), output="tokens").rows()
    assert tokens.shape == (Rows.gather(picks).tokens, model.embedder.config.hidden_size)


@pytest.mark.parametrize("variant", ["bert", "modernbert-attend"])
def test_prepared_ids_sent_back_give_the_same_rows_and_vectors(models, variant):
    model = models[variant]
    for role in ROLES.values():
        texts = GOLDEN["queries"] if role == "query" else GOLDEN["documents"]
        rows = model.prepare(texts, TextOptions(prompt_name=role))
        again = model.prepare(rows.tolist(), TextOptions())
        assert again.tolist() == rows.tolist()
        for mine, theirs in zip(_vectors(model, again), _vectors(model, rows)):
            assert_embeddings_close(mine, theirs)
    colbert = model.describe().text.colbert
    long_query = [101, colbert.query_marker] + [1037] * 30 + [102]
    cut = model.prepare([long_query], TextOptions()).tolist()[0]
    assert cut == long_query[: colbert.query_length - 1] + [102]
    left = model.prepare([long_query], TextOptions(direction="left")).tolist()[0]
    assert left[:2] == long_query[:2] and len(left) == colbert.query_length and left[-1] == 102
    with pytest.raises(InputTooLong):
        model.prepare([long_query], TextOptions(truncate=False))


def test_multi_vector_counts_per_role(models):
    model = models["bert"]
    colbert = model.describe().text.colbert
    rows = Rows.of([[101, colbert.document_marker, 1996, 1010, 999, 102],   # a document: two skiplist ids
                    [101, colbert.query_marker, 1010, 102, colbert.mask_id, colbert.mask_id],  # a query: every token
                    [101]])
    assert multi_vector_counts(model.describe(), rows).tolist() == [4, 6, 1]
    m3_like = Description("m3", "embedding", 8, 16, "cpu", outputs=("pooled", "tokens", "colbert", "sparse"))
    assert multi_vector_counts(m3_like, rows).tolist() == [5, 5, 0]
    plain = Description("plain", "embedding", 8, 16, "cpu")
    assert multi_vector_counts(plain, rows).tolist() == [6, 6, 1]


@pytest.mark.parametrize("variant", ["bert", "modernbert"])
def test_the_text_side_round_trips_as_data(models, variant):
    model = models[variant]
    spec = model.describe().text
    assert spec.colbert is not None
    rebuilt = TextSpec.from_json(spec.to_json())
    assert rebuilt == spec
    assert Description.from_json(model.describe().to_json()) == model.describe()
    side = text_side(rebuilt)
    ids = model.prepare(GOLDEN["documents"][:2], TextOptions(prompt_name="document")).tolist()
    for inputs, options in [(GOLDEN["queries"], TextOptions()), (GOLDEN["queries"], TextOptions(prompt_name="query")),
                            (GOLDEN["documents"], TextOptions(prompt_name="document")), (ids, TextOptions()),
                            (GOLDEN["queries"][:2], TextOptions(details=True))]:
        mine, theirs = side.prepare(inputs, options), model.prepare(inputs, options)
        assert np.array_equal(mine.ids, theirs.ids) and np.array_equal(mine.lengths, theirs.lengths)
    details = model.prepare(["What is ColBERT?"], TextOptions(details=True)).details[0]
    assert details[1].id == spec.colbert.query_marker and details[1].special


def test_a_process_without_torch_prepares_queries_and_documents_from_the_spec(models, tmp_path):
    """A front-end's view: the text side rebuilt from the description's JSON in a fresh interpreter prepares both roles
    and counts each row's vectors, without torch."""
    model = models["modernbert"]
    script = textwrap.dedent("""
        import json, sys
        from fusedserve.model import text_side
        from fusedserve.model.api import Description, TextOptions, multi_vector_counts
        description = Description.from_json(sys.stdin.read())
        side, texts = text_side(description.text), json.loads(sys.argv[1])
        rows = {role: side.prepare(texts, TextOptions(prompt_name=role)) for role in ("query", "document")}
        print(json.dumps({"ids": {role: r.tolist() for role, r in rows.items()},
                          "counts": {role: multi_vector_counts(description, r).tolist() for role, r in rows.items()},
                          "torch": "torch" in sys.modules}))
    """)
    result = subprocess.run([sys.executable, "-c", script, json.dumps(GOLDEN["documents"])], cwd=tmp_path,
                            input=model.describe().to_json(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["torch"] is False
    for role in ("query", "document"):
        rows = model.prepare(GOLDEN["documents"], TextOptions(prompt_name=role))
        assert report["ids"][role] == rows.tolist()
        assert report["counts"][role] == [len(v) for v in _vectors(model, rows)]


def test_what_a_colbert_model_refuses(models):
    model = models["bert"]
    for text in ("what is [MASK]?", "[MASK]"):
        for role in ("query", "document"):
            with pytest.raises(InvalidInput, match=r"mask token '\[MASK\]'"):
                model.prepare(["fine", text], TextOptions(prompt_name=role))
    with pytest.raises(InvalidInput, match="second id must be the query marker 1 .* or the document marker 2"):
        model.prepare([[101, 2054, 102]], TextOptions())
    with pytest.raises(InvalidInput, match="second id must be"):
        model.prepare([[101]], TextOptions())
    with pytest.raises(InvalidInput, match="not text pairs"):
        model.prepare([("a", "b")], TextOptions())
    with pytest.raises(InputTooLong, match="over the limit of 24"):
        model.prepare(["word " * 40], TextOptions(prompt_name="document", truncate=False))
    rows = model.prepare(["fine"], TextOptions())
    for output in ("pooled", "sparse"):
        with pytest.raises(InputError, match=f"ColBERT model: it gives 'tokens' and 'colbert'.*no '{output}' output"):
            model.launch(rows, output=output)


def _stanford(source: Path, dest: Path, metadata: dict | None) -> Path:
    """A Stanford (colbert-ir/colbertv2.0) layout of a checkpoints.colbert BERT directory: config.json architectures
    HF_ColBERT, the encoder's tensors under bert., the projection as linear.weight beside them, the settings in
    artifact.metadata; no modules.json nor config_sentence_transformers.json."""
    from safetensors.torch import load_file, save_file

    dest.mkdir()
    tensors = {f"bert.{name}": t for name, t in load_file(source / "model.safetensors").items()
               if not name.startswith("pooler.")}
    tensors["linear.weight"] = load_file(source / "1_Dense" / "model.safetensors")["linear.weight"]
    save_file(tensors, dest / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "architectures": ["HF_ColBERT"]}))
    for name in checkpoints.TOKENIZER_FILES:
        if (source / name).is_file():
            (dest / name).write_bytes((source / name).read_bytes())
    if metadata is not None:
        (dest / "artifact.metadata").write_text(json.dumps(metadata))
    return dest


def test_the_stanford_layout_equals_pylate(directories, models, tmp_path):
    """PyLate reads a Stanford checkpoint's projection and settings into the same model as the PyLate layout's (the
    golden script's author checked that PyLate's outputs of the two layouts are the same)."""
    golden = GOLDEN["variants"]["bert"]
    path = _stanford(directories["bert"], tmp_path / "stanford", {
        "query_token_id": "[unused0]", "doc_token_id": "[unused1]", "query_maxlen": 12, "doc_maxlen": 24,
        "attend_to_mask_tokens": False, "dim": 24, "similarity": "cosine"})
    model = load(str(path), LoadOptions(device="cpu", dtype="float32"))
    try:
        assert model.describe().text.colbert == models["bert"].describe().text.colbert
        for key, role in ROLES.items():
            rows = model.prepare(GOLDEN[key], TextOptions(prompt_name=role))
            assert rows.tolist() == [text["input_ids"] for text in golden[key]]
            for mine, theirs in zip(_vectors(model, rows), golden[key]):
                assert_embeddings_close(mine, theirs["vectors"], what=f"stanford {role}")
    finally:
        model.stop()
    # without artifact.metadata: PyLate's [unused0] / [unused1] markers and its default lengths
    bare = load(str(_stanford(directories["bert"], tmp_path / "bare", None)), LoadOptions(device="cpu"))
    try:
        colbert = bare.describe().text.colbert
        assert (colbert.query_marker, colbert.document_marker, colbert.query_length, colbert.document_length) == \
            (1, 2, 32, 180)
    finally:
        bare.stop()


def test_a_directory_without_a_projection_is_refused(directories, tmp_path):
    no_dense = checkpoints.colbert(tmp_path / "no-dense")
    modules = json.loads((no_dense / "modules.json").read_text())
    (no_dense / "modules.json").write_text(json.dumps(modules[:1]))
    with pytest.raises(UnsupportedModel, match="without a Dense module.*randomly initialised"):
        load(str(no_dense), LoadOptions(device="cpu", dtype="float32"))
    stanford = _stanford(directories["bert"], tmp_path / "stanford", None)
    from safetensors.torch import load_file, save_file

    tensors = load_file(stanford / "model.safetensors")
    del tensors["linear.weight"]
    save_file(tensors, stanford / "model.safetensors")
    with pytest.raises(UnsupportedModel, match="HF_ColBERT. without linear.weight"):
        load(str(stanford), LoadOptions(device="cpu", dtype="float32"))
    tanh = checkpoints.colbert(tmp_path / "tanh")
    dense = json.loads((tanh / "1_Dense" / "config.json").read_text())
    (tanh / "1_Dense" / "config.json").write_text(json.dumps(
        {**dense, "activation_function": "torch.nn.modules.activation.Tanh"}))
    with pytest.raises(UnsupportedModel, match="Dense activation 'torch.nn.modules.activation.Tanh'"):
        load(str(tanh), LoadOptions(device="cpu", dtype="float32"))
