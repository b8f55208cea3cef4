"""A model's text side as data (model.tokenizer.TextSpec): what the loaded model decided (tokenizer, length limit,
vocabulary, lower-casing, prompts, a reranker's template), rebuilt from JSON without torch, prepares every input as
the model does."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from fusedserve.model import api, load, text_side
from fusedserve.model.api import TextSpec
from tests.model import checkpoints

TEXTS = ["A man is eating food.", "Ünïcödé, ‘quotes’ and 数字 123", "x", "Long " * 400]
PAIRS = [("what is packed attention?", "Sequences back to back, no padding."), ("q", "d " * 300)]


def _models(root):
    minilm = checkpoints.minilm(root / "minilm", ["mean"], prompts={"query": "query: ", "doc": "passage: "},
                                default_prompt="query")
    config = minilm / "sentence_bert_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "do_lower_case": True}))
    yield "minilm lower-case, a default prompt", minilm
    yield "cross-encoder pairs", checkpoints.cross_encoder(root / "ce", 1)
    yield "gemma3 prompts", checkpoints.gemma3(root / "gemma")
    yield "llama add_eos_token", checkpoints.llama(root / "llama")
    yield "qwen3 reranker template", checkpoints.qwen3_reranker(root / "qwen-rr")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("text-spec")
    return {what: load(str(path), api.LoadOptions(device="cpu", fused=False)) for what, path in _models(root)}


def _same(a: api.Rows, b: api.Rows) -> None:
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.lengths, b.lengths)
    assert (a.second is None) == (b.second is None)
    if a.second is not None:
        assert np.array_equal(a.second, b.second)


def _inputs(served) -> list[tuple[object, api.TextOptions]]:
    text = served.embedder.text
    id_rows = [[5, 6, 7], [3 + i % (text.vocab_size - 3) for i in range(600)]]  # the second over every limit
    cases = [(TEXTS, api.TextOptions()), (TEXTS, api.TextOptions(direction="left")),
             (id_rows, api.TextOptions()), (id_rows, api.TextOptions(direction="left")),
             (TEXTS[:2], api.TextOptions(details=True))]
    for name in text.prompts:
        cases.append((TEXTS, api.TextOptions(prompt_name=name)))
    if served.embedder.classifier is not None:
        cases.append((PAIRS, api.TextOptions()))
    return cases


def test_the_spec_rebuilt_from_json_prepares_as_the_model_does(models):
    for what, served in models.items():
        spec = served.describe().text
        assert spec == served.embedder.text.spec(), what
        rebuilt = TextSpec.from_json(spec.to_json())
        assert rebuilt == spec, what
        side = text_side(rebuilt)
        for inputs, options in _inputs(served):
            _same(side.prepare(inputs, options), served.prepare(inputs, options))
        rows = served.prepare(TEXTS[:2], api.TextOptions()).tolist()
        for skip in (True, False):
            assert side.decode(rows, skip) == served.decode(rows, skip), what
        with pytest.raises(api.InvalidInput, match="outside the vocabulary"):
            side.prepare([[0, spec.vocab_size]], api.TextOptions())


def test_the_spec_names_what_the_model_decided(models):
    minilm = models["minilm lower-case, a default prompt"].embedder.text.spec()
    assert minilm.lower_case and minilm.default_prompt_name == "query" and minilm.max_length == 256
    assert dict(minilm.prompts) == {"query": "query: ", "doc": "passage: "}
    reranker = models["qwen3 reranker template"].embedder.text.spec()
    assert reranker.pair_template is not None and "{query}" in reranker.pair_template.body


def test_a_process_without_torch_prepares_from_the_spec(models, tmp_path):
    """A fresh interpreter builds the text side from the JSON alone and prepares texts; torch and the kernels never
    load there."""
    served = models["llama add_eos_token"]
    spec = served.embedder.text.spec()
    script = textwrap.dedent("""
        import json, sys
        from fusedserve.model import text_side
        from fusedserve.model.api import TextOptions, TextSpec
        side = text_side(TextSpec.from_json(sys.argv[1]))
        rows = side.prepare(json.loads(sys.argv[2]), TextOptions())
        loaded = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "triton"})
        print(json.dumps({"ids": rows.tolist(), "loaded": loaded,
                          "kernels": any(m.startswith("fusedserve.kernels") for m in sys.modules)}))
    """)
    result = subprocess.run([sys.executable, "-c", script, spec.to_json(), json.dumps(TEXTS)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["loaded"] == [] and report["kernels"] is False, report
    assert report["ids"] == served.prepare(TEXTS, api.TextOptions()).tolist()


def test_the_description_round_trips_through_json(models):
    for what, served in models.items():
        described = served.describe()
        back = api.Description.from_json(described.to_json())
        assert back == described, what
