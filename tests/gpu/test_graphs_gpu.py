"""Packed layout + CUDA graphs on the GPU: graph replays equal the eager packed and padded paths (within the embedding
tolerance table, tests/tolerances.py), graphs are reused per bucket, dropped when the kernel selection
changes, skipped on the reference path, and batches outside the buckets run eagerly."""

from __future__ import annotations

import gc

import pytest
import torch

from fusedserve.model.runner import Embedder
from tests.gpu.test_minilm_gpu import _model_dir
from tests.model.sentences import SENTENCES
from tests.tolerances import assert_embeddings_close

pytestmark = pytest.mark.gpu


def _random_batches(tokenizer, seed: int, count: int, max_tokens: int = 1024):
    """`count` batches of 1-16 test sentences drawn at random, as token ids of at most max_tokens in all."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(count):
        n = int(torch.randint(1, 17, (1,), generator=gen))
        ids = tokenizer.encode([SENTENCES[int(i)] for i in torch.randint(0, len(SENTENCES), (n,), generator=gen)])
        while sum(map(len, ids)) > max_tokens:
            ids.pop()
        yield ids


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_graphs_equal_eager_packed_and_padded(dtype):
    graphed, _ = Embedder.load(str(_model_dir()), device="cuda", dtype=dtype, backend="cuda", max_batch_tokens=4096,
                                max_batch=128)
    padded, _ = Embedder.load(str(_model_dir()), device="cuda", dtype=dtype, backend="cuda", layout="padded")
    assert graphed.graphs is not None and padded.graphs is None
    for texts in (SENTENCES[:1], SENTENCES[:7], SENTENCES):
        ids = graphed.tokenizer.encode(texts)
        a = graphed.embed_ids(ids)
        b = graphed.embed_ids(ids, graphs=False)  # eager packed
        c = padded.embed_ids(ids)
        assert torch.isfinite(a).all()
        assert_embeddings_close(a, b, dtype, what="graph vs eager packed")
        assert_embeddings_close(a, c, dtype, what="graph vs eager padded")
    stats = graphed.graphs.stats()
    assert stats["graphs"] == stats["captures"] == 3 and stats["replays"] == 3
    assert stats["pool_bytes"] > 0
    graphed.embed_ids(graphed.tokenizer.encode(SENTENCES[:7]))
    assert graphed.graphs.stats()["captures"] == 3  # same bucket: replayed, not recaptured


def test_replays_survive_reuse_of_freed_memory():
    """Graphs replayed after the allocator has handed their capture-time neighbours' memory to other tensors (and
    returned the cache to the driver) still read only what they own: poison everything freed, replay, compare."""
    e, _ = Embedder.load(str(_model_dir()), device="cuda", dtype="float16", backend="cuda", max_batch_tokens=4096,
                         max_batch=128)
    batches = [e.tokenizer.encode(SENTENCES[:n]) for n in (3, 20, 65)]
    eager = [e.embed_ids(ids, graphs=False) for ids in batches]
    for ids in batches:
        e.embed_ids(ids)  # capture
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    poison = torch.full((64 << 20,), 2**62 - 1, dtype=torch.long, device="cuda")  # huge ids/indices if read
    for ids, ref in zip(batches, eager):
        out = e.embed_ids(ids)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        assert_embeddings_close(out, ref, "float16")
    assert e.graphs.stats()["captures"] == 3 and e.graphs.stats()["replays"] == 6
    del poison


def test_selection_change_drops_graphs_and_reference_path_skips_them():
    """Graphs are keyed on the Embedder's selection version: the fused switch (set_fused) and a fallback drop them
    and the next batch captures into a fresh pool; a reference re-run never replays a graph."""
    e, _ = Embedder.load(str(_model_dir()), device="cuda", dtype="float16", backend="cuda", max_batch_tokens=4096,
                         max_batch=64)
    ids = e.tokenizer.encode(SENTENCES[:5])
    fused = e.embed_ids(ids)
    assert e.graphs.stats()["captures"] == 1
    ref = e.embed_ids(ids, reference=True)
    assert e.graphs.stats()["replays"] == 1  # the reference re-run ran eagerly
    version = e.kernel_path.selection.version
    e.kernel_path.set_fused(False)
    assert e.kernel_path.selection.version > version
    gc.collect()  # nothing but the holder keeps a dropped graph alive, so its pool's use count reaches 0
    off = e.embed_ids(ids)  # new fingerprint: the fused graph must not be replayed (and capture needs a fresh pool)
    assert e.graphs.stats()["captures"] == 2 and e.graphs.stats()["graphs"] == 1
    for _ in range(3):  # toggled back and forth: every drop is followed by a capture into a new pool
        e.kernel_path.set_fused(True)
        gc.collect()
        again = e.embed_ids(ids)
        e.kernel_path.set_fused(False)
        gc.collect()
        assert_embeddings_close(e.embed_ids(ids), off, "float16")
    assert e.graphs.stats()["captures"] == 8
    e.kernel_path.set_fused(True)
    e.embed_ids(ids)
    e.kernel_path.fall_back("all", "test")  # a fallback drops them too
    gc.collect()
    fallen = e.embed_ids(ids)
    assert e.graphs.stats()["captures"] == 10 and e.kernel_path.label == "reference"
    assert_embeddings_close(fallen, off, "float16")
    assert_embeddings_close(again, fused, "float16")
    assert_embeddings_close(off, ref, "float16")
    assert_embeddings_close(fused, ref, "float16")


def test_one_graph_held_evicts_and_recaptures():
    """max_graphs=1: each new bucket evicts the only graph, so the pool is empty at every capture."""
    e, _ = Embedder.load(str(_model_dir()), device="cuda", dtype="float16", backend="cuda", max_batch_tokens=4096,
                         max_batch=64, max_graphs=1)
    batches = [e.tokenizer.encode(SENTENCES[:n]) for n in (3, 20, 3, 20)]
    eager = [e.embed_ids(ids, graphs=False) for ids in batches]
    for ids, ref in zip(batches, eager):
        out = e.embed_ids(ids)
        gc.collect()
        assert torch.isfinite(out).all()
        assert_embeddings_close(out, ref, "float16")
    stats = e.graphs.stats()
    assert stats["graphs"] == 1 and stats["captures"] == 4 and stats["evictions"] == 3


def test_outside_buckets_runs_eagerly():
    e, _ = Embedder.load(str(_model_dir()), device="cuda", dtype="float16", backend="cuda", max_batch_tokens=64,
                         max_batch=2)
    ids = e.tokenizer.encode(SENTENCES[:4])  # more rows than the largest batch bucket
    out = e.embed_ids(ids)
    assert e.graphs.stats()["eager_fallbacks"] == 1 and e.graphs.stats()["captures"] == 0
    assert torch.isfinite(out).all() and out.shape == (4, 384)


def testvarlen_attention_matches_pad_attention():
    from fusedserve.model.packing import Packed, packed_mean_pool

    e, _ = Embedder.load(str(_model_dir()), device="cuda", dtype="float16", backend="cuda")
    packed = Packed.from_rows(e.tokenizer.encode(SENTENCES[:16]), "cuda")
    with torch.inference_mode():
        a = packed_mean_pool(e.encoder.forward_packed(packed, "pad"), packed, True)
        b = packed_mean_pool(e.encoder.forward_packed(packed, "varlen"), packed, True)
    assert_embeddings_close(a, b, "float16")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fused_attention_graphs_match_the_padded_path(dtype):
    """ATTENTION=fused on the real MiniLM: single requests and small batches (the four-kernel few-token layer), a
    larger batch (qkv_attention + the usual blocks), through CUDA graphs, against the padded eager path."""
    e, _ = Embedder.load(str(_model_dir()), device="cuda", dtype=dtype, backend="triton", attention="fused",
                         max_batch_tokens=4096, max_batch=128)
    padded, _ = Embedder.load(str(_model_dir()), device="cuda", dtype=dtype, backend="triton", layout="padded")
    assert e.kernel_path.attention == "fused"
    for texts in (SENTENCES[:1], SENTENCES[1:4], SENTENCES):
        ids = e.tokenizer.encode(texts)
        a, c = e.embed_ids(ids), padded.embed_ids(ids)
        assert torch.isfinite(a).all()
        assert_embeddings_close(a, c, dtype)
    assert e.graphs.stats()["replays"] == 3 and e.graphs.stats()["eager_fallbacks"] == 0


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_dense_batches_replay_unmasked_graphs(dtype):
    """Equal-length rows that fill their bucket (the fixed-shape case) take the dense graph: no mask, no
    scatter; the result still equals the padded eager path."""
    e, _ = Embedder.load(str(_model_dir()), device="cuda", dtype=dtype, backend="cuda", max_batch_tokens=4096,
                         max_batch=64)
    padded, _ = Embedder.load(str(_model_dir()), device="cuda", dtype=dtype, backend="cuda", layout="padded")
    gen = torch.Generator().manual_seed(0)
    ids = [[101] + torch.randint(1000, 20000, (30,), generator=gen).tolist() + [102] for _ in range(16)]
    assert e.graphs.bucket(ids) == (512, 16, 32, True)
    a, c = e.embed_ids(ids), padded.embed_ids(ids)
    assert e.graphs.stats()["captures"] == 1
    assert_embeddings_close(a, c, dtype)


def test_capture_all_covers_the_traffic():
    """The warm-up's capture_all captures every reachable varlen bucket; mixed batches afterwards replay without
    a single new capture and equal the eager path."""
    e, _ = Embedder.load(str(_model_dir()), device="cuda", dtype="float16", backend="cuda", max_batch_tokens=1024,
                         max_batch=16)
    # auto without the few-token ops (no CUDA kernels for them)
    assert e.kernel_path.attention == "varlen", e.kernel_path.attention_reason
    assert "would run on the reference" in e.kernel_path.attention_reason
    captured = e.graphs.capture_all()
    assert captured == len(e.graphs.reachable_keys()) == e.graphs.stats()["captures"] > 0
    for ids in _random_batches(e.tokenizer, seed=3, count=12):
        a, b = e.embed_ids(ids), e.embed_ids(ids, graphs=False)
        assert_embeddings_close(a, b, "float16")
    assert e.graphs.stats()["captures"] == captured  # nothing captured under traffic


@pytest.mark.parametrize("attention", ["fused", "varlen"])
def test_programmatic_dependent_launch_changes_no_bit(attention):
    """FUSEDSERVE_TRITON_PDL: the same kernels in the same order with the same configs, only allowed to start while
    their predecessor finishes, so results must be bitwise those without it: graphs (captured with it) and eager
    launches, over many batches of new inputs, each compared with the same batch without PDL. A kernel that read
    (or wrote) before the one before it had finished would show as a difference."""
    from fusedserve.kernels.triton._common import pdl_launches

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90 or later")
    options = dict(device="cuda", dtype="float16", backend="triton", attention=attention, max_batch_tokens=1024,
                   max_batch=16)
    with pdl_launches(False):
        plain, _ = Embedder.load(str(_model_dir()), **options)
        with_pdl, _ = Embedder.load(str(_model_dir()), **options)

    def embed(e, pdl: bool, ids, graphs: bool):
        with pdl_launches(pdl):  # graphs are captured on a bucket's first batch, with the setting of that moment
            return e.embed_ids(ids, graphs=graphs)

    for step, ids in enumerate(_random_batches(plain.tokenizer, seed=11, count=40)):
        graphs = step % 4 != 3  # every fourth batch eagerly
        a, b = embed(with_pdl, True, ids, graphs), embed(plain, False, ids, graphs)
        assert torch.isfinite(a).all()
        assert torch.equal(a, b), (step, len(ids), float((a - b).abs().max()))
    assert with_pdl.graphs.stats()["replays"] == 30 and with_pdl.graphs.stats()["eager_fallbacks"] == 0


def test_auto_attention_follows_the_fused_switch():
    """ATTENTION=auto on the GPU: the few-token layer while its ops are fused (Triton), varlen while the fused path is
    off (the server's /admin/fused), the few-token layer again when it is back; graphs are recaptured on each change
    and every result agrees with the eager padded path."""
    e, _ = Embedder.load(str(_model_dir()), device="cuda", dtype="float16", backend="triton", max_batch_tokens=1024,
                         max_batch=16)
    padded, _ = Embedder.load(str(_model_dir()), device="cuda", dtype="float16", backend="triton", layout="padded")
    # a single request and three short ones (the few-token layer), sixteen (varlen in either mode)
    batches = [e.tokenizer.encode(texts) for texts in (SENTENCES[:1], SENTENCES[1:4], SENTENCES[:16])]
    expected = [padded.embed_ids(ids) for ids in batches]
    for fused, attention in ((True, "fused"), (False, "varlen"), (True, "fused")):
        e.kernel_path.set_fused(fused)
        assert e.kernel_path.attention == e.graphs.attention == attention, e.kernel_path.attention_reason
        for ids, want in zip(batches, expected):
            got = e.embed_ids(ids)
            assert torch.isfinite(got).all()
            assert_embeddings_close(got, want, "float16", what=f"{attention}, {len(ids)} inputs")
    stats = e.graphs.stats()  # each change dropped the graphs: every pass captured its three buckets anew
    assert stats["captures"] == stats["replays"] == 9 and stats["eager_fallbacks"] == 0, stats
