"""Embedder: presets, dtype/device resolution, and the reference/fused switch."""

from __future__ import annotations

import pytest
import torch

from fusedserve.model import loading
from fusedserve.model.config import EncoderConfig
from fusedserve.model.loading import resolve_device, resolve_dtype
from fusedserve.model.runner import Embedder
from tests.tolerances import assert_embeddings_close, assert_same_rows


def test_presets():
    assert EncoderConfig.from_name("bert-base").hidden_size == 768
    assert EncoderConfig.from_name("minilm-l6").num_layers == 6
    with pytest.raises(ValueError, match="unknown encoder preset 'gpt'"):
        EncoderConfig.from_name("gpt")
    with pytest.raises(ValueError, match="not divisible"):
        EncoderConfig(hidden_size=100, num_heads=12)


def test_tiny_preset_runs_and_reports():
    embedder, report = Embedder.load("tiny", device="cpu")
    out = embedder.embed(["one", "two words", "three words here"])
    assert out.shape == (3, 64) and torch.isfinite(out).all()
    assert not torch.allclose(out[0], out[1])
    text = str(report)
    assert "tiny (random init)" in text and "device cpu, dtype float32" in text
    assert "add_layer_norm" in text


def test_fused_triton_on_interpreter_matches_reference_path():
    fused, report = Embedder.load("tiny", device="cpu", backend="triton")
    assert {c.backend for c in report.kernels.choices.values() if c.used} == {"triton"}
    a = fused.embed(["same input", "and a second, longer input"])
    plain, report = Embedder.load("tiny", device="cpu", fused=False)
    assert "fused path off" in report.kernels.report()
    assert {c.backend for c in report.kernels.choices.values()} == {"torch"}
    assert_embeddings_close(a, plain.embed(["same input", "and a second, longer input"]))


def test_fused_attention_on_the_interpreter_matches_the_reference_path():
    texts = ["same input", "and a second, longer input", "a third"]
    fused, report = Embedder.load("tiny", device="cpu", backend="triton", attention="fused")
    assert fused.kernel_path.attention == "fused" and report.kernels.backend_of("qkv_attention") == "triton"
    plain, _ = Embedder.load("tiny", device="cpu", fused=False)
    assert plain.kernel_path.attention == "varlen"  # the CPU's: one attention per sequence
    assert_embeddings_close(fused.embed(texts), plain.embed(texts))


def test_auto_attention_takes_the_few_token_layer_only_while_its_ops_are_fused(monkeypatch):
    """Where varlen runs, auto attention is "fused" (the few-token layer up to 64 tokens, varlen above) as long as
    the selection puts the few-token ops on a fused backend, and varlen, saying why, when any is on the reference:
    after the fused switch, a fallback of one of them, or an override. The CPU stands in for a GPU here (varlen
    declared runnable; no forward runs): only the decision is tested."""
    import fusedserve.model.packing as packing_module
    from fusedserve.model.bert import kernel_ops
    from fusedserve.model.packing import FEW_TOKEN_OPS

    monkeypatch.setattr(packing_module, "varlen_runs", lambda device, dtype: True)
    e, report = Embedder.load("tiny", device="cpu", backend="triton")
    path = e.kernel_path
    assert path.attention == "fused" and "few-token layer" in path.attention_reason, path.attention_reason
    assert all(report.kernels.backend_of(op) == "triton" for op in FEW_TOKEN_OPS)
    assert set(e.kernel_path.selection.used) == set(kernel_ops("packed", "fused", e.device, e.dtype))
    selection = e.kernel_path.set_fused(False)
    assert e.kernel_path.attention == "varlen" and "reference" in e.kernel_path.attention_reason
    assert set(selection.used) == set(kernel_ops("packed", "varlen", e.device, e.dtype))
    e.kernel_path.set_fused(True)  # fused again: back to the few-token layer
    assert e.kernel_path.attention == "fused"
    before = e.kernel_path.selection
    fallen = e.kernel_path.fall_back("ffn_partials", "verify_mismatch")
    assert fallen.version > before.version and e.kernel_path.fallback == "verify_mismatch" and not e.kernel_path.fused
    assert e.kernel_path.attention == "varlen" and "ffn_partials" in e.kernel_path.attention_reason
    assert fallen.choices["ffn_partials"].reason == "fallback: verify_mismatch"
    e.kernel_path.set_fused(True)
    assert e.kernel_path.attention == "fused" and e.kernel_path.fallback is None and e.kernel_path.fused
    overridden, _ = Embedder.load("tiny", device="cpu", backend="triton", backend_overrides={"ffn_partials": "torch"})
    assert overridden.kernel_path.attention == "varlen" and "ffn_partials" in overridden.kernel_path.attention_reason
    asked, _ = Embedder.load("tiny", device="cpu", fused=False, attention="fused")
    assert asked.kernel_path.attention == "fused"
    assert asked.kernel_path.attention_reason == "as configured"  # asked for: kept


def test_the_path_changes_only_between_forwards_through_the_embedder():
    """set_fused / fall_back / use install a new selection (a new version, so CUDA graphs are re-captured); the
    forward runs on the Embedder's selection, whatever is installed around the call; timed() labels each op's time
    with the backend that ran it; reference_copy() is an fp32 model of its own on the reference."""
    from fusedserve import kernels

    e, _ = Embedder.load("tiny", device="cpu", backend="triton")
    texts = ["same input", "and a second, longer input"]
    fused = e.embed(texts)
    with kernels.use(kernels.REFERENCE):  # the caller's context does not change the model's path
        assert torch.equal(e.embed(texts), fused)
    seen = []
    with e.forwards.timed(lambda op, backend, seconds: seen.append((op, backend, seconds))):
        # bitwise: timing only observes the same forward
        assert_same_rows(e.embed(texts), fused, what="the timed forward")
    assert {(op, backend) for op, backend, _ in seen} == set(e.kernel_path.selection.used.items())
    assert all(seconds > 0 for *_, seconds in seen)
    e.kernel_path.fall_back("all", "test")
    seen.clear()
    with e.forwards.timed(lambda op, backend, seconds: seen.append((op, backend))):
        on_reference = e.embed(texts)
    assert {backend for _, backend in seen} == {"torch"} and e.kernel_path.label == "reference"
    assert_embeddings_close(on_reference, fused)
    copy = e.reference_copy()
    assert copy.dtype == torch.float32 and copy.kernel_path.label == "reference" and copy.encoder is not e.encoder
    assert_embeddings_close(copy.embed(texts), fused)
    big, small = e.warmup.warmup_batches()
    assert len(big[0]) == e.config.max_seq_length and len(small) == 1
    assert big[0][0] == small[0][0] == 101 and big[0][-1] == small[0][-1] == 102  # the tokenizer's [CLS], [SEP]


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_timed_steps_time_the_same_calls_as_timed_one_block_per_step(layout):
    """timed_steps: the eager forward one block per step (packed: the embeddings, then each layer, then the head on
    the last; padded: one step), each op call timed and labelled as timed() does, reported after the last step, and
    no selection or observer active between steps."""
    from fusedserve import kernels

    e, _ = Embedder.load("tiny", device="cpu", backend="triton", layout=layout)
    batch = e.tokenizer.encode(["a first input", "and a second, longer input than the first"])
    whole: list = []
    with e.forwards.timed(lambda op, backend, seconds: whole.append((op, backend))):
        e.embed_ids(batch)
    stepped: list = []
    steps = e.timed_steps(batch, lambda op, backend, seconds: stepped.append((op, backend, seconds)))
    yields = 0
    for _ in steps:
        yields += 1
        assert not stepped  # reported once, after the last block
        assert kernels.current() is not e.kernel_path.selection  # nothing held across a yield
    assert yields == (e.config.num_layers + 1 if layout == "packed" else 0)
    assert [(op, backend) for op, backend, _ in stepped] == whole
    assert all(seconds > 0 for *_, seconds in stepped)


def test_timed_steps_stop_unreported_when_the_selection_changes_between_steps():
    """A fallback (or any new selection) between two steps ends the timed forward there, nothing reported: the rest
    would time a path no longer served, and a fallback's op may be the broken one."""
    e, _ = Embedder.load("tiny", device="cpu", backend="triton")
    seen: list = []
    steps = e.timed_steps(e.tokenizer.encode(["one input"]), lambda *call: seen.append(call))
    next(steps)
    e.kernel_path.fall_back("all", "test")
    assert list(steps) == [] and seen == []


@pytest.mark.skipif(not loading.cpu_half_isa(torch.bfloat16), reason="this CPU has no bfloat16 instructions "
                    "(amx_bf16, avx512_bf16): the setting is refused here")
def test_bfloat16_on_cpu_is_close_to_float32():
    f32, _ = Embedder.load("default", device="cpu", dtype="float32", backend="torch")
    bf16, _ = Embedder.load("default", device="cpu", dtype="bfloat16", backend="torch")
    texts = ["A man is eating food.", "The girl is carrying a baby."]
    assert_embeddings_close(bf16.embed(texts), f32.embed(texts), torch.bfloat16)


def test_a_half_type_on_the_cpu_needs_the_instructions_for_it(monkeypatch):
    """bfloat16 / float16 on the CPU is the opt-in lower-precision path: refused, naming the flags, on a CPU that
    would only emulate it; float32 and auto never need a flag."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(loading, "cpu_flags", lambda: frozenset({"avx512f", "avx512_vnni"}))
    with pytest.raises(ValueError, match="bfloat16 on the CPU needs a CPU with amx_bf16 or avx512_bf16"):
        resolve_dtype("bfloat16", cpu)
    with pytest.raises(ValueError, match="float16 on the CPU needs a CPU with amx_fp16 or avx512_fp16"):
        resolve_dtype("float16", cpu)
    with pytest.raises(ValueError, match="bfloat16 on the CPU"):  # before any weight loads
        Embedder.load("tiny", device="cpu", dtype="bfloat16")
    assert resolve_dtype("float32", cpu) == resolve_dtype("auto", cpu) == torch.float32
    assert loading.cpu_isa(cpu, torch.float32) == torch.backends.cpu.get_cpu_capability()
    monkeypatch.setattr(loading, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16", "amx_tile"}))
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16 and loading.cpu_isa(cpu, torch.bfloat16) == "amx_bf16"
    assert loading.cpu_isa(torch.device("cuda"), torch.bfloat16) is None


def test_unnormalized_output_and_empty_batch():
    embedder, _ = Embedder.load("default", device="cpu", backend="torch")
    raw = embedder.embed(["hello"], normalize=False)
    assert float(raw.norm()) > 1.5  # mean-pooled MiniLM vectors are far from unit length
    assert embedder.embed([]).shape == (0, 384)


def test_resolution_errors():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("float8", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")
