"""PRECISION=fp8 in the model (model.runner.Embedder, model/bert.py's forward_fp8): refused where it cannot run,
naming why; on the CPU (FP8 GEMMs run there through torch._scaled_mm, so the path is forced on for these tests
only) the real MiniLM against sentence-transformers in fp32, and the switches: the fallback tier back to the
dtype's fused path, the fused switch, the verifier's reference copy."""

from __future__ import annotations

import pytest
import torch

from fusedserve.kernels import fp8
from fusedserve.model import describing
from fusedserve.model.config import UnsupportedModel
from fusedserve.model.runner import Embedder
from tests.model.checkpoints import source_dir
from tests.model.sentences import SENTENCES
from tests.tolerances import assert_embeddings_close, embedding_errors, tolerance


def test_refused_on_the_cpu():
    with pytest.raises(UnsupportedModel, match="PRECISION=fp8 cannot serve .*device cpu has no FP8 tensor cores"):
        Embedder.load("tiny", device="cpu", precision="fp8")


def test_a_precision_of_another_name_is_refused():
    with pytest.raises(ValueError, match="precision must be one of native, fp8, got 'int4'"):
        Embedder.load("tiny", device="cpu", precision="int4")


@pytest.fixture
def fp8_here(monkeypatch):
    """FP8 allowed on this CPU (a test-only stand-in for an FP8 GPU): the quantizing ops run their references."""
    monkeypatch.setattr(fp8, "unavailable", lambda device: None)


def test_families_without_the_path_are_refused(fp8_here):
    with pytest.raises(UnsupportedModel, match="GTE models have no FP8 path"):
        Embedder.load("gte-base", device="cpu", precision="fp8")


TEXTS = SENTENCES[:32]  # one batch (FP8 GEMMs on the CPU are emulated: slow), the short and odd ones among them


@pytest.fixture(scope="module")
def st_reference() -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(source_dir()), device="cpu")
    return torch.from_numpy(st.encode(TEXTS, batch_size=32, convert_to_numpy=True))


def test_minilm_in_fp8_against_sentence_transformers(fp8_here, st_reference):
    embedder, report = Embedder.load(str(source_dir()), device="cpu", dtype="float32", precision="fp8")
    assert embedder.kernel_path.active_precision == "fp8" and embedder.describe()["precision"] == {
        "requested": "fp8", "active": "fp8", "fallback": None}
    # one byte a weight, four a channel's scale
    gemms = [getattr(layer, name).weight for layer in embedder.encoder.layers
             for name in ("qkv", "attn_out", "ffn_in", "ffn_out")]
    assert embedder.kernel_path.fp8_bytes == sum(w.numel() + 4 * w.shape[0] for w in gemms)
    assert "FP8 GEMMs for every batch" in describing.path_line(embedder)
    ours = embedder.embed(TEXTS)
    cosine, _ = assert_embeddings_close(ours, st_reference, torch.float8_e4m3fn, what="fp8")
    # FP8 is the lossy step: it must move the answer past float32's entry of the table (the fp32 path meets that
    # entry against sentence-transformers in tests/model/test_parity.py), or it did not run
    assert embedding_errors(ours, st_reference)[0] < tolerance(torch.float32).min_cosine


def test_fallback_tier_and_switches(fp8_here):
    embedder, _ = Embedder.load(str(source_dir()), device="cpu", dtype="float32", precision="fp8")
    native, _ = Embedder.load(str(source_dir()), device="cpu", dtype="float32")
    texts = SENTENCES[:8]
    fp8_out = embedder.embed(texts)
    assert not torch.equal(fp8_out, native.embed(texts))

    assert embedder.kernel_path.fall_back_precision("fp8_mismatch") is True
    assert embedder.kernel_path.fall_back_precision("fp8_mismatch") is False  # once
    assert embedder.describe()["precision"] == {"requested": "fp8", "active": "native", "fallback": "fp8_mismatch"}
    assert embedder.kernel_path.fused  # the dtype's fused path, not the reference
    assert "FP8 GEMMs off (fp8_mismatch)" in describing.path_line(embedder)
    assert torch.equal(embedder.embed(texts), native.embed(texts))

    embedder.kernel_path.set_fused(True)  # the admin switch clears the fallback, as it clears fall_back's
    assert embedder.kernel_path.active_precision == "fp8"
    assert torch.equal(embedder.embed(texts), fp8_out)
    embedder.kernel_path.set_fused(False)  # every op on the reference: no FP8 either
    assert embedder.kernel_path.active_precision == "native"
    embedder.kernel_path.set_fused(True)
    embedder.kernel_path.fall_back("all", "verify_mismatch")
    assert embedder.kernel_path.active_precision == "native"


def test_the_reference_copy_leaves_the_fp8_weights_behind(fp8_here):
    embedder, _ = Embedder.load(str(source_dir()), device="cpu", dtype="float32", precision="fp8")
    copy = embedder.reference_copy()
    assert copy.encoder.fp8_weights is None and copy.kernel_path.active_precision == "native"
    assert embedder.encoder.fp8_weights is not None and embedder.kernel_path.active_precision == "fp8"
    assert_embeddings_close(copy.embed(SENTENCES[:8]),
                            Embedder.load(str(source_dir()), device="cpu", dtype="float32")[0].embed(SENTENCES[:8]))


@pytest.mark.slow  # MPNet-base's shape on the CPU, in FP8 and in float32
def test_mpnet_runs_its_relative_attention_between_fp8_gemms(fp8_here, monkeypatch):
    # MPNet's layers are BERT's (model/layers.py PostNormLayer) but for the attention (its relative bias table,
    # model/mpnet.py attend)
    embedder, _ = Embedder.load("mpnet-base", device="cpu", dtype="float32", precision="fp8")
    calls = []
    linear = fp8.linear
    monkeypatch.setattr(fp8, "linear", lambda *args: calls.append(args[2]) or linear(*args))
    texts = SENTENCES[:3]
    ours = embedder.embed(texts)
    assert len(calls) == 4 * embedder.config.num_layers  # every GEMM of every layer, once
    embedder.kernel_path.fall_back_precision("test")  # the same weights on the float32 path
    want = embedder.embed(texts)
    assert len(calls) == 4 * embedder.config.num_layers
    assert_embeddings_close(ours, want, torch.float8_e4m3fn, what="MPNet, random weights")
    assert embedding_errors(ours, want)[0] < tolerance(torch.float32).min_cosine
