"""No request pays an autotune or a compile: after the start-up's shape sweep (WarmupPlanner.shape_sweep), eager
forwards of batches of any size (what a kernel-timed sample, a batch outside every CUDA-graph bucket or serving without
graphs runs) meet only kernels already tuned and compiled for their shape. On a GPU, the sweep itself compiles nothing that
Forwards.compile_ahead (the start-up's compile pass before it) left out.

The Triton autotuners' caches hold one entry per tuned key; the JIT functions' caches one entry per compiled variant.
On the CPU the interpreter runs the autotuner (with its CPU benchmark) and compiles nothing; on a GPU both count."""

from __future__ import annotations

import random
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction

from fusedserve.model.config import EncoderConfig
from fusedserve.model.bert import Encoder
from fusedserve.model.packing import FUSED_LAYER_TOKENS
from fusedserve.model.runner import Embedder
from fusedserve.model.tokenizer import TextTokenizer
from tests.model.checkpoints import source_dir


def _kernels() -> tuple[list[Autotuner], list[JITFunction]]:
    tuners, jitted = [], []
    for name, module in list(sys.modules.items()):
        if not name.startswith("fusedserve.kernels.triton") or module is None:
            continue
        for obj in vars(module).values():
            fn = obj
            if isinstance(obj, Autotuner):
                tuners.append(obj)
            while hasattr(fn, "fn") and not isinstance(fn, JITFunction):  # autotuner / heuristics -> the kernel
                fn = fn.fn
            if isinstance(fn, JITFunction):
                jitted.append(fn)
    return tuners, list({id(f): f for f in jitted}.values())


def _state() -> tuple[dict[int, set], int]:
    tuners, jitted = _kernels()
    compiled = sum(len(entry[0]) for fn in jitted for entry in getattr(fn, "device_caches", {}).values())
    return {id(t): set(t.cache) for t in tuners}, compiled


def _random_batches(e: Embedder, count: int, seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    longest = e.tokenizer.encode(["warm up " * e.config.max_seq_length])[0]
    batches = []
    for _ in range(count):
        rows, budget = [], rng.randint(1, e.max_batch_tokens)
        while budget > 0 and len(rows) < e.max_batch:
            length = min(rng.randint(1, len(longest)), budget)
            rows.append(longest[:length])
            budget -= length
        batches.append(rows)
    return batches


def test_after_the_shape_sweep_no_eager_forward_tunes_or_compiles(device):
    """On this machine's device: the Triton interpreter here, the GPU there (fp16, compiles counted too)."""
    dtype = torch.float16 if device == "cuda" else torch.float32
    config = EncoderConfig.from_name("tiny")
    e = Embedder(Encoder(config), TextTokenizer(source_dir(), config.max_seq_length), "tiny", torch.device(device),
                 dtype, backend="triton", cuda_graphs=False, max_batch_tokens=128, max_batch=8)
    e.kernel_path.set_fused(True)
    sweep = e.warmup.shape_sweep()
    assert {sum(map(len, b)).bit_length() for b in sweep} == set(range(1, e.max_batch_tokens.bit_length() + 1))
    if device == "cuda":  # the server compiles the sweep's kernels side by side first, tuning nothing
        before_tuned, before_compiled = _state()
        e.forwards.compile_ahead(sweep)
        ahead_tuned, ahead_compiled = _state()
        assert ahead_tuned == before_tuned, "compile_ahead tuned a key: the sweep's real launches must time them"
        assert ahead_compiled > before_compiled, "compile_ahead compiled nothing"
    for batch in sweep:
        e.embed_ids(batch, graphs=False)
    tuned, compiled = _state()
    assert any(tuned.values()), "the sweep ran no autotuned Triton kernel: the test would prove nothing"
    if device == "cuda":
        assert compiled == ahead_compiled, f"the sweep compiled {compiled - ahead_compiled} kernels not compiled ahead"
    seen, seed = [], int(torch.randint(1 << 30, ()))
    with e.forwards.timed(lambda op, backend, seconds: seen.append(backend)):
        for batch in _random_batches(e, 6 if device == "cpu" else 40, seed=seed):
            e.embed_ids(batch, graphs=False)
    assert "triton" in seen
    after, compiled_after = _state()
    new = {k: after[k] - tuned.get(k, set()) for k in after if after[k] - tuned.get(k, set())}
    assert not new, f"an eager forward after the sweep autotuned (batches of seed {seed}): {new}"
    assert compiled_after == compiled, f"an eager forward after the sweep compiled a kernel (seed {seed})"


@pytest.mark.parametrize("max_batch_tokens", [128, 1000, 16384])
def test_the_sweep_meets_every_bucket_at_both_token_parities(max_batch_tokens):
    """Each token-count bucket (kernels.row_bucket, the tuned configs' key) is swept at an even and an odd count, as
    full rows and as two unequal rows: the packed batch's index rows are views of one buffer, 16-byte aligned only
    for an even count, and Triton compiles a config once per alignment, so a bucket swept at one parity would leave
    the other's compile to the first request."""
    from fusedserve.kernels._layout import row_bucket

    config = EncoderConfig.from_name("tiny")
    e = Embedder(Encoder(config), TextTokenizer(source_dir(), config.max_seq_length), "tiny", torch.device("cpu"),
                 torch.float32, backend="torch", cuda_graphs=False, max_batch_tokens=max_batch_tokens, max_batch=64)
    most = min(max_batch_tokens, 64 * e.config.max_seq_length)
    seen: dict[int, set[int]] = {}
    two_rows: dict[int, set[int]] = {}
    sweep = e.warmup.shape_sweep()
    for batch in sweep:
        tokens = sum(map(len, batch))
        assert tokens <= most
        seen.setdefault(row_bucket(tokens), set()).add(tokens % 2)
        if len(batch) == 2 and len(batch[0]) != len(batch[1]):
            two_rows.setdefault(row_bucket(tokens), set()).add(tokens % 2)

    def parities(bucket: int, limit: int) -> set[int]:  # of the counts a batch of this bucket can have
        first = 1 << (bucket - 1)
        return {c % 2 for c in range(first, min(2 * first - 1, limit) + 1)}

    assert seen == {b: parities(b, most) for b in range(1, row_bucket(most) + 1)}, seen
    counts = {sum(map(len, batch)) for batch in sweep}
    assert FUSED_LAYER_TOKENS + 1 in counts or FUSED_LAYER_TOKENS >= most  # the layered path's first count
    one_row = min(most, e.config.max_seq_length)
    for bucket in range(3, row_bucket(one_row) + 1):  # two unequal rows need 3 tokens
        assert two_rows[bucket] >= parities(bucket, one_row), (bucket, two_rows)


@pytest.mark.gpu
def test_a_batch_of_equal_rows_at_a_new_length_builds_no_cudnn_attention_plan(monkeypatch):
    """Rows of one length (a lone request) take torch's SDPA, where torch prefers cuDNN's attention on Hopper; cuDNN
    builds an execution plan per new shape, which every eager batch at a new length and every graph capture paid while
    requests waited (docs/decisions/0014-sdpa-without-cudnn-attention.md). The encoder keeps SDPA on backends without
    per-shape plans. First the control: with cuDNN allowed again, the same kind of batch does reach cuDNN here (else
    the check proves nothing on this GPU and torch, and the test skips saying so)."""
    import fusedserve.model.packing as packing_module

    config = EncoderConfig.from_name("minilm-l6")  # MiniLM's 32-wide heads, where the plans were seen
    e = Embedder(Encoder(config), None, "minilm", torch.device("cuda"), torch.float16, attention="pad",
                 cuda_graphs=False, max_batch_tokens=256, max_batch=8)
    e.kernel_path.set_fused(True)
    e.embed_ids([[101, 2000, 102]], graphs=False)  # one-time initialisation outside the profiles

    def attention_ops(length: int) -> set[str]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            e.embed_ids([[101] + [2000 + i for i in range(length - 2)] + [102]] * 2, graphs=False)  # equal rows
        names = {event.key for event in prof.key_averages()}
        assert "aten::scaled_dot_product_attention" in names, "the batch did not reach SDPA"
        return {n for n in names if "attention" in n}

    with monkeypatch.context() as patch:
        patch.setattr(packing_module, "SDPA_BACKENDS", [SDPBackend.CUDNN_ATTENTION, *packing_module.SDPA_BACKENDS])
        lifted = attention_ops(29)
    if not any("cudnn_attention" in n for n in lifted):
        pytest.skip(f"torch does not choose cuDNN attention for these rows on this GPU ({sorted(lifted)})")
    pinned = attention_ops(37)  # another new length
    assert not any("cudnn_attention" in n for n in pinned), sorted(pinned)
