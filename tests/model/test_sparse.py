"""SPLADE models (sentence-transformers' SparseEncoder directories: MLMTransformer or a fill-mask Transformer, then
SpladePooling) against SparseEncoder.encode on the same directory, fp32 on the CPU, on the torch reference (the fused
head runs on the GPU: tests/gpu/test_sparse_gpu.py; its kernel on the interpreter: tests/kernels/test_splade_pool.py).
What a sparse model cannot be served as is refused by name."""

from __future__ import annotations

import json

import pytest
from sentence_transformers import SparseEncoder

from fusedserve.model.config import UnsupportedModel
from fusedserve.model.runner import Embedder
from tests.model import checkpoints
from tests.tolerances import assert_sparse_close

TEXTS = ["A man is eating food.", "Fused kernels make encoders fast, even for a single short request.", "x",
         "The quick brown fox jumps over the lazy dog " * 12]


def _reference(path, texts=TEXTS):
    return SparseEncoder(str(path), device="cpu").encode(texts, convert_to_tensor=True).to_dense()


@pytest.mark.parametrize("architecture,style,activation", [("bert", "mlm", "relu"), ("bert", "fill-mask", "log1p_relu"),
                                                           ("distilbert", "mlm", "relu")])
def test_sparse_models_match_sparse_encoder(tmp_path, architecture, style, activation):
    path = checkpoints.splade(tmp_path / "s", activation=activation, architecture=architecture, style=style)
    ours, report = Embedder.load(str(path), device="cpu", backend="torch")
    assert ours.kind == "sparse" and ours.dim == 30522 and "SPLADE sparse vectors" in str(report)
    assert_sparse_close(ours.embed(TEXTS, normalize=False), _reference(path))


@pytest.mark.slow
def test_a_base_width_sparse_model_matches_sparse_encoder(tmp_path):
    """splade-v3's width (768, the decoder onto 30,522 entries) on a long input."""
    path = checkpoints.splade(tmp_path / "s", shape="base")
    ours, _ = Embedder.load(str(path), device="cpu", backend="torch")
    texts = [TEXTS[1], "x", "sparse lexical expansion over the whole vocabulary " * 25]
    assert_sparse_close(ours.embed(texts, normalize=False), _reference(path, texts))


def test_what_a_sparse_model_cannot_serve_is_refused(tmp_path):
    path = checkpoints.splade(tmp_path / "s")
    pooling = path / "1_SpladePooling" / "config.json"
    config = json.loads(pooling.read_text())
    for change, named in (({"pooling_strategy": "sum"}, "pooling_strategy 'sum'"),
                          ({"activation_function": "gelu"}, "activation_function 'gelu'"),
                          ({"embedding_dimension": 1000}, "embedding_dimension")):
        pooling.write_text(json.dumps({**config, **change}))
        with pytest.raises(UnsupportedModel, match=named):
            Embedder.load(str(path), device="cpu")
    pooling.write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="POOLING does not apply"):
        Embedder.load(str(path), device="cpu", pooling="cls")
    modules = json.loads((path / "modules.json").read_text())
    (path / "modules.json").write_text(json.dumps([*modules, {"idx": 2, "name": "2", "path": "2_Normalize",
                                                              "type": "sentence_transformers.models.Normalize"}]))
    with pytest.raises(UnsupportedModel, match="MLMTransformer then SpladePooling only"):
        Embedder.load(str(path), device="cpu")
