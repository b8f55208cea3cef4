"""The packed (padding-free) layout equals the padded one: same embeddings on mixed lengths, with and without
CUDA-graph-style buckets (filler tokens and filler sequences), and the bucket arithmetic the graphs use."""

from __future__ import annotations

import contextlib
import itertools
import time

import numpy as np
import pytest
import torch

from fusedserve.model import packing as packing_module
from fusedserve.model import graphs as graphs_module
from fusedserve.model.api import Rows
from fusedserve.model.config import EncoderConfig
from fusedserve.model.bert import Encoder
from fusedserve.model.packing import Packed, mean_pool, packed_mean_pool, resolve_attention, varlen_runs
from fusedserve.model.graphs import SEQ_BUCKETS, CudaGraphs, token_buckets
from tests.tolerances import assert_embeddings_close


@pytest.fixture(scope="module")
def encoder():
    torch.manual_seed(0)
    enc = Encoder(EncoderConfig.from_name("tiny").replace(num_layers=2)).eval()
    with torch.no_grad():  # non-trivial biases and norms, so every term of the math is exercised
        for name, p in enc.named_parameters():
            if "bias" in name or "ln_weight" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return enc


def _rows(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[101] + torch.randint(1000, 5000, (n - 2,), generator=gen).tolist() + [102] for n in lengths]


def _padded(encoder, rows):
    seq = max(map(len, rows))
    ids = torch.zeros(len(rows), seq, dtype=torch.long)
    mask = torch.zeros(len(rows), seq, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = True
    return mean_pool(encoder(ids, mask), mask, normalize=False)


@pytest.mark.parametrize("attention", ["pad", "varlen"])
@pytest.mark.parametrize("lengths", [[2], [2, 3], [7, 40, 3, 128, 16, 2, 99], [5] * 9])
@torch.no_grad()
def test_packed_equals_padded(encoder, lengths, attention):
    rows = _rows(lengths, seed=len(lengths))
    padded = _padded(encoder, rows)
    packed = Packed.from_rows(rows, "cpu")
    assert packed.input_ids.numel() == sum(lengths)  # no padding at all
    ours = packed_mean_pool(encoder.forward_packed(packed, attention), packed, normalize=False)
    assert torch.isfinite(ours).all()
    assert_embeddings_close(ours, padded)


@torch.no_grad()
def test_the_cpus_varlen_attends_within_each_sequence_only():
    """sequence_attention (varlen on the CPU) against the float64 formula per sequence: odd lengths, empty (filler)
    sequences, filler rows past the last sequence poisoned with NaN (never read; their context is zeros), under the
    SDPA flags lock like every other SDPA call of the encoder."""
    from fusedserve.kernels.testing import compare
    from fusedserve.model.packing import sequence_attention

    heads, d = 3, 16
    for lengths in ([1], [7, 0, 300, 1, 33], [769, 4]):
        gen = torch.Generator().manual_seed(sum(lengths))
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        total = int(cu[-1])
        qkv = torch.randn(total + 5, 3 * heads * d, generator=gen)
        qkv[total:] = float("nan")
        out = sequence_attention(qkv, cu, heads)
        assert torch.equal(out[total:], torch.zeros_like(out[total:]))
        for start, end in zip(cu.tolist(), cu.tolist()[1:]):
            if end == start:
                continue
            q, k, v = qkv[start:end].double().view(end - start, 3, heads, d).permute(1, 2, 0, 3)
            expected = torch.softmax(q @ k.transpose(1, 2) / d**0.5, dim=-1) @ v
            report = compare(out[start:end], expected.transpose(0, 1).reshape(end - start, -1), torch.float32)
            assert report.ok, (lengths, start, report)


@torch.no_grad()
def test_dense_batches_skip_mask_and_scatter(encoder, monkeypatch):
    rows = _rows([16] * 4)
    packed = Packed.from_rows(rows, "cpu")
    assert packed.dense and not Packed.from_rows(_rows([16, 15]), "cpu").dense
    assert not Packed.from_rows(rows, "cpu", tokens=80).dense  # filler tokens: not dense
    calls = []
    original = torch.Tensor.index_copy_
    monkeypatch.setattr(torch.Tensor, "index_copy_", lambda *a: calls.append(1) or original(*a))
    ours = packed_mean_pool(encoder.forward_packed(packed), packed, normalize=False)
    assert not calls  # no scatter into a padded block
    assert_embeddings_close(ours, _padded(encoder, rows))


@torch.no_grad()
def test_sdpa_runs_off_cudnn_under_the_flags_lock(encoder, monkeypatch):
    """Every SDPA call of the encoder (the padded path and the dense packed one) runs with cuDNN's attention off and
    the module's lock held: torch's backend flags are process-wide, and another thread leaving its own pinned block
    must not switch cuDNN back on under this one (decision 0014). The flags are restored afterwards."""

    before = (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled())
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((packing_module._SDPA_FLAGS.locked(), torch.backends.cuda.cudnn_sdp_enabled(),
                     torch.backends.cuda.flash_sdp_enabled()))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    _padded(encoder, _rows([9, 4]))  # masked padded batch
    encoder.forward_packed(Packed.from_rows(_rows([6] * 3), "cpu"))  # dense packed batch
    encoder.forward_packed(Packed.from_rows(_rows([6, 3]), "cpu"), "varlen")  # one SDPA per sequence
    assert len(seen) == 4 * len(encoder.layers), seen
    assert all(locked and not cudnn and flash for locked, cudnn, flash in seen), seen
    assert (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()) == before
    assert not packing_module._SDPA_FLAGS.locked()


@torch.no_grad()
def test_bucketed_packing_with_filler_tokens_and_sequences(encoder):
    rows = _rows([7, 40, 3, 33, 2])
    padded = _padded(encoder, rows)
    packed = Packed.from_rows(rows, "cpu", tokens=128, batch=8, seq=64)
    assert packed.input_ids.numel() == 128 and packed.batch == 8
    pooled = packed_mean_pool(encoder.forward_packed(packed), packed, normalize=False)
    assert torch.isfinite(pooled).all()  # filler sequences attend to one (filler) key: no NaN
    assert_embeddings_close(pooled[:5], padded)
    with pytest.raises(ValueError, match="too small"):
        Packed.from_rows(rows, "cpu", tokens=64, batch=8, seq=64)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@torch.no_grad()
def test_fused_attention_equals_padded(encoder, backend):
    """attention="fused" (the Triton kernels on the interpreter, or the torch references) on mixed lengths in buckets
    with filler tokens and filler sequences: above FUSED_LAYER_TOKENS (qkv_attention + the usual blocks) and below it
    (the four-kernel few-token layer), and on a dense batch of 64 tokens."""
    from fusedserve import kernels
    from fusedserve.model.packing import FUSED_LAYER_TOKENS

    with kernels.use(kernels.select("cpu", (torch.float32,), backend=backend)):
        for lengths, tokens in (([7, 40, 3, 33, 2], 128), ([7, 20, 3, 2], 48)):
            rows = _rows(lengths)
            packed = Packed.from_rows(rows, "cpu", tokens=tokens, batch=8, seq=64)
            assert (tokens <= FUSED_LAYER_TOKENS) == (tokens == 48)
            pooled = packed_mean_pool(encoder.forward_packed(packed, "fused"), packed, normalize=False)
            assert torch.isfinite(pooled).all()
            assert_embeddings_close(pooled[: len(rows)], _padded(encoder, rows))
        dense = _rows([16] * 4)
        packed = Packed.from_rows(dense, "cpu")
        pooled = packed_mean_pool(encoder.forward_packed(packed, "fused"), packed, normalize=False)
        assert_embeddings_close(pooled, _padded(encoder, dense))


@torch.no_grad()
def test_kernel_ops_name_exactly_the_ops_each_path_calls(encoder, monkeypatch):
    """The registry tests and races only kernel_ops(layout, attention, ...): an op missing there would run on the
    reference unnoticed, one too many costs start-up compiles. Each path's calls, over batches above and below
    FUSED_LAYER_TOKENS, must be exactly that set."""
    from fusedserve import kernels
    from fusedserve.model.bert import kernel_ops

    cpu = torch.device("cpu")
    called: set[str] = set()

    def observer(op, backend, fn, args, kwargs):
        called.add(op)
        return fn(*args, **kwargs)

    rows = [_rows([7, 40, 3, 33, 2]), _rows([7, 20, 3, 2])]
    for attention in ("pad", "fused"):
        called.clear()
        for r in rows:
            packed = Packed.from_rows(r, "cpu")
            with kernels.use(kernels.REFERENCE, observer):
                packed_mean_pool(encoder.forward_packed(packed, attention), packed, normalize=False)
        assert called == set(kernel_ops("packed", attention, cpu, torch.float32)), attention
    called.clear()
    for r in rows:
        with kernels.use(kernels.REFERENCE, observer):
            _padded(encoder, r)
    assert called == set(kernel_ops("padded", "pad", cpu, torch.float32))
    cuda = torch.device("cuda")  # where varlen runs, fused mode runs it above FUSED_LAYER_TOKENS: no qkv_attention
    assert set(kernel_ops("packed", "varlen", cuda, torch.float16)) == \
        set(kernel_ops("packed", "pad", cpu, torch.float32))
    if varlen_runs(cuda, torch.float16):
        assert set(kernel_ops("packed", "fused", cuda, torch.float16)) == \
            set(kernel_ops("packed", "fused", cpu, torch.float32)) - {"qkv_attention"}


def test_runner_configures_only_the_ops_it_calls():
    from fusedserve.model.bert import kernel_ops
    from fusedserve.model.runner import Embedder

    embedder, report = Embedder.load("tiny", device="cpu", backend="torch")
    used = {op for op, c in report.kernels.choices.items() if c.used}
    assert used == set(kernel_ops("packed", embedder.kernel_path.attention, embedder.device, embedder.dtype))
    assert "qkv_attention" not in used
    assert "not called by this model" in report.kernels.report()
    assert report.kernels.as_dict()["ops"]["ffn_partials"]["used"] is False
    overridden, _ = Embedder.load("tiny", device="cpu", backend="torch", backend_overrides={"ffn_partials": "torch"})
    assert overridden.kernel_path.selection.choices["ffn_partials"].used  # asked for by name: chosen as asked
    fused, _ = Embedder.load("tiny", device="cpu", backend="torch", attention="fused")
    assert fused.kernel_path.attention == "fused"
    assert set(fused.kernel_path.selection.used) == set(kernel_ops("packed", "fused", fused.device, fused.dtype))


def test_packed_indices():
    p = Packed.from_rows([[5, 6, 7], [8, 9]], "cpu", tokens=8, batch=4, seq=4)
    assert p.input_ids.tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert p.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 0, 0]
    assert p.pad_index.tolist() == [0, 1, 2, 4, 5, 16, 16, 16]  # filler -> scratch row 16
    assert p.seq_index.tolist() == [0, 0, 0, 1, 1, 4, 4, 4]    # filler -> scratch sequence 4
    assert p.lengths.tolist() == [3, 2, 1, 1]
    assert p.cu_seqlens.tolist() == [0, 3, 5, 5, 5]  # filler sequences: zero-length for varlen attention
    assert p.attn_mask.squeeze().tolist()[1] == [True, True, False, False]


def test_packed_from_buffers_only_views_its_buffers():
    """A CUDA graph captured on a Packed reads its tensors on every replay: all of them must be views of the two
    static buffers the graph keeps. (A token-type tensor allocated on the side was freed after the capture and
    the replays read whatever reused that memory: an illegal address on the H200.)"""
    flat, lengths, _ = Packed.host_buffers([[5, 6, 7], [8, 9]], 8, 4, 4)
    assert flat.shape == (len(Packed.FIELDS), 8) and flat[Packed.FIELDS.index("token_type_ids")].eq(0).all()
    p = Packed.from_buffers(flat, lengths, 4)
    for name in Packed.FIELDS:
        assert getattr(p, name).untyped_storage().data_ptr() == flat.untyped_storage().data_ptr(), name
    assert p.lengths.untyped_storage().data_ptr() == lengths.untyped_storage().data_ptr()


def test_host_buffers_overwrite_every_element_of_reused_buffers():
    """The CUDA graphs refill the same pinned buffers batch after batch: a fill must not leave anything of the
    previous batch (or of uninitialised memory) behind."""
    rows = [[5, 6, 7], [8, 9]]
    fresh, fresh_lengths, fresh_cu = Packed.host_buffers(rows, 8, 4, 4)
    assert fresh_cu.tolist() == [0, 3, 5, 5, 5]
    flat, lengths, cu = torch.full((6, 8), -7), torch.full((4,), -7), torch.full((5,), -7, dtype=torch.int32)

    def fill(batch):
        Packed.fill(batch, flat.numpy(), lengths.numpy(), 4, cu_seqlens=cu.numpy())

    fill([[1] * 4, [2] * 4])  # a previous, longer batch
    for _ in range(2):
        fill(rows)
        assert torch.equal(flat, fresh) and torch.equal(lengths, fresh_lengths) and torch.equal(cu, fresh_cu)
        flat.fill_(-7), lengths.fill_(-7), cu.fill_(-7)
    with torch.inference_mode():  # the graphs fill them under inference mode
        fill(rows)
    assert torch.equal(flat, fresh)


def _fill_by_hand(rows: list[list[int]], tokens: int, batch: int, seq: int, pad: int, offset: int,
                  second: list[int] | None) -> tuple[list[list[int]], list[int], list[int]]:
    """Packed.fill's arrays written out token by token: the fields, the lengths, cu_seqlens."""
    fields = [[pad] * tokens, [offset] * tokens, [0] * tokens, [batch * seq] * tokens, [batch * seq - 1] * tokens,
              [batch] * tokens]
    t = 0
    for r, ids in enumerate(rows):
        for i, token in enumerate(ids):
            fields[0][t], fields[1][t], fields[3][t], fields[4][t], fields[5][t] = token, i + offset, r * seq + i, \
                r * seq + i, r
            fields[2][t] = int(second is not None and i >= second[r])
            t += 1
    lengths = [len(ids) for ids in rows] + [1] * (batch - len(rows))
    cu = [0]
    for ids in rows:
        cu.append(cu[-1] + len(ids))
    return fields, lengths, cu + [cu[-1]] * (batch - len(rows))


@pytest.mark.parametrize("tokens", [48, 600])  # from the layout cache, and computed in place past its limit
def test_fill_writes_every_field_as_by_hand_into_poisoned_buffers(tokens):
    """Random rows of random lengths, position offsets and text pairs, refilled into the same poisoned buffers (the
    graphs' reuse): every element as the token-by-token fill says, the cached layout untouched by the writes."""
    gen = np.random.default_rng(7)
    flat, lengths, cu = (np.full(shape, -7, dtype=dt) for shape, dt in
                         (((6, tokens), np.int64), ((8,), np.int64), ((9,), np.int32)))
    for trial in range(12):
        n = int(gen.integers(1, 9))
        seq = int(gen.integers(1, tokens // 8 + 1))
        rows = [gen.integers(5, 30000, int(gen.integers(1, seq + 1))).tolist() for _ in range(n)]
        offset, pad = int(gen.choice([0, 2])), int(gen.choice([0, 1]))
        second = [int(gen.integers(1, len(r) + 1)) for r in rows] if trial % 3 == 0 else None
        batch_rows = Rows.of(rows)
        if second is not None:
            batch_rows = Rows(batch_rows.ids, batch_rows.lengths, np.array(second, dtype=np.int64))
        Packed.fill(batch_rows, flat, lengths, seq, pad, position_offset=offset, pair_types=True, cu_seqlens=cu)
        want_fields, want_lengths, want_cu = _fill_by_hand(rows, tokens, 8, seq, pad, offset, second)
        assert flat.tolist() == want_fields and lengths.tolist() == want_lengths and cu.tolist() == want_cu
        flat[:], lengths[:], cu[:] = -7, -7, -7  # the cache's arrays are not these: poisoning them leaves it whole
        Packed.fill(batch_rows, flat, lengths, seq, pad, position_offset=offset, pair_types=True, cu_seqlens=cu)
        assert flat.tolist() == want_fields and cu.tolist() == want_cu
    index, *_ = packing_module._cached_layout(np.array([3], dtype=np.int64).tobytes(), 16, 1, 4, 0)
    with pytest.raises(ValueError, match="read-only"):
        index[0, 0] = 1


def test_graph_input_buffer_is_one_copy_of_fields_lengths_and_offsets():
    """A graph's whole input is one int64 buffer (one host-to-device copy a batch): its views fill as Packed.fill
    writes, a copy of it reads back as the batch Packed.from_rows makes, and cu_seqlens is int32 in its tail."""
    rows = [[5, 6, 7], [8, 9], [4]]
    tokens, batch, seq = 16, 4, 8
    host = torch.full((graphs_module._buffer_size(tokens, batch),), -7, dtype=torch.long)
    flat, lengths, cu = graphs_module._views(host, tokens, batch)
    assert cu.dtype == torch.int32 and cu.is_contiguous() and cu.shape == (batch + 1,)
    for b in (1, 4, 5):  # 16-byte aligned, as the eager path's offsets are (Triton specializes on it)
        buffer = torch.empty(graphs_module._buffer_size(tokens, b), dtype=torch.long)
        views = graphs_module._views(buffer, tokens, b)
        assert all((v.data_ptr() - buffer.data_ptr()) % 16 == 0 for v in views), b
        end = buffer.data_ptr() + 8 * buffer.numel()
        assert views[2].shape == (b + 1,) and views[2].data_ptr() + 4 * (b + 1) <= end
    for view in (flat, lengths, cu):
        assert view.untyped_storage().data_ptr() == host.untyped_storage().data_ptr()
    Packed.fill(rows, flat.numpy(), lengths.numpy(), seq, cu_seqlens=cu.numpy())
    device = host.clone()  # what the graph reads after the copy
    got_flat, got_lengths, got_cu = graphs_module._views(device, tokens, batch)
    got = Packed.from_buffers(got_flat, got_lengths, seq, cu_seqlens=got_cu)
    want = Packed.from_rows(rows, "cpu", tokens=tokens, batch=batch, seq=seq)
    for name in (*Packed.FIELDS, "lengths", "cu_seqlens"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


@pytest.fixture
def cpu_graphs(monkeypatch, encoder):
    """CudaGraphs on the CPU with torch.cuda's calls faked: a "graph" whose replay runs the captured forward again on
    the graph's static buffers, which is what a real replay does. Run, fill, buffers and capture are the real code."""
    class Event:
        def record(self):
            pass

        def synchronize(self):
            pass

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            pass

    class Graph:
        def replay(self):
            self.rerun()

    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *args, pin_memory=False, **kwargs: empty(*args, **kwargs))
    for name, fake in (("Event", Event), ("Stream", Stream), ("CUDAGraph", Graph),
                       ("stream", lambda stream: contextlib.nullcontext()),
                       ("current_stream", lambda device=None: Stream()),
                       ("graph", lambda *args, **kwargs: contextlib.nullcontext()),
                       ("graph_pool_handle", object), ("memory_reserved", lambda device=None: 0)):
        monkeypatch.setattr(torch.cuda, name, fake)
    graphs = CudaGraphs(encoder, torch.device("cpu"), max_tokens=64, max_batch=4, attention="varlen")
    capture = graphs._capture

    def capture_with_rerun(key):
        entry = capture(key)

        def rerun():
            with torch.inference_mode():
                entry.pooled.copy_(graphs.head(encoder.forward_packed(entry.packed, "varlen"), entry.packed))

        entry.graph.rerun = rerun
        return entry

    monkeypatch.setattr(graphs, "_capture", capture_with_rerun)
    return graphs


def test_graph_replays_read_each_batch_from_the_one_buffer_they_fill(encoder, cpu_graphs):
    """Batch after batch through the same buckets (fewer rows than the bucket, different lengths, one row again):
    each replay answers its own batch, as the eager padded forward does, through the fill of the graph's one input
    buffer (ids, indices, lengths and the int32 offsets the varlen attention reads)."""
    batches = [_rows([7]), _rows([5, 9, 3], seed=1), _rows([12, 4], seed=2), _rows([9], seed=3), _rows([7], seed=4)]
    with torch.inference_mode():
        for rows in batches:
            got = cpu_graphs.run(Rows.of(rows)).clone()
            assert_embeddings_close(got, _padded(encoder, rows))
    assert cpu_graphs.replays == len(batches) and cpu_graphs.captures == len(cpu_graphs.graphs) < len(batches)


def test_token_buckets_bound_the_filler():
    buckets = token_buckets(16384)
    assert buckets[0] == 16 and buckets[-1] == 16384 and buckets == sorted(set(buckets))
    for small, big in zip(buckets, buckets[1:]):
        # steps of a quarter of a power of two, an eighth above 1024 tokens (at most 12.5% filler there)
        step = max(small // 4, 16) if small < 1024 else small // 8
        assert big - small <= step, (small, big)
        if small >= 1024:
            assert (big - small) / big <= 0.125
    assert token_buckets(5000)[-1] >= 5000 and SEQ_BUCKETS[-1] == 512


def test_runner_layouts_agree_on_cpu():
    from fusedserve.model.runner import Embedder

    texts = ["a short one", "a much longer sentence, with several more words than the first one has", "x"]
    packed, _ = Embedder.load("tiny", device="cpu", backend="torch")
    padded, _ = Embedder.load("tiny", device="cpu", backend="torch", layout="padded")
    assert packed.layout == "packed" and packed.graphs is None  # no CUDA graphs off the GPU
    assert_embeddings_close(packed.embed(texts), padded.embed(texts))
    with pytest.raises(ValueError, match="layout"):
        Embedder.load("tiny", device="cpu", layout="ragged")


def test_graph_buckets(encoder):
    from fusedserve.model.graphs import CudaGraphs

    graphs = CudaGraphs(encoder, torch.device("cuda"), max_tokens=4096, max_batch=64)  # no GPU needed for this
    assert graphs.bucket(_rows([16] * 32)) == (512, 32, 16, True)  # fills its bucket exactly: dense
    assert graphs.bucket(_rows([16] * 31)) == (512, 32, 16, False)
    assert graphs.bucket(_rows([7, 40, 3])) == (64, 4, 64, False)
    assert graphs.bucket(_rows([2])) == (16, 1, 16, False)
    assert graphs.bucket(_rows([16])) == (16, 1, 16, True)
    assert graphs.bucket(_rows([2] * 65)) is None  # more rows than the largest batch bucket
    assert graphs.bucket(_rows([200] * 30)) is None  # more tokens than the largest token bucket


def test_varlen_graph_buckets_drop_the_sequence_length():
    """With varlen attention the longest row only bounds the attention grid: batches of different longest rows
    share a graph, rows go to powers of 4, and seq is min(model's longest, tokens); dense (fixed-shape) batches
    keep their own unmasked graph."""
    enc = Encoder(EncoderConfig.from_name("minilm-l6"))
    pad = CudaGraphs(enc, torch.device("cpu"), max_tokens=4096, max_batch=64)
    varlen = CudaGraphs(enc, torch.device("cpu"), max_tokens=4096, max_batch=64, attention="varlen")
    short, long_ = [[1] * 10, [1] * 30], [[1] * 3, [1] * 37]
    assert pad.bucket(short) != pad.bucket(long_)
    assert varlen.bucket(short) == varlen.bucket(long_) == (48, 4, 48, False)
    assert varlen.bucket([[1] * 200] * 5)[:3] == (1024, 16, 256)  # MiniLM truncates at 256 tokens
    assert varlen.bucket([[1] * 32] * 16) == (512, 16, 32, True)
    assert varlen.reachable_keys() and pad.reachable_keys() == []
    assert resolve_attention("auto", torch.device("cpu"), torch.float32) == "varlen"  # one SDPA per sequence
    assert resolve_attention("auto", torch.device("cuda"), torch.float32) == "pad"
    assert resolve_attention("auto", torch.device("cuda"), torch.float16) == (
        "fused" if varlen_runs(torch.device("cuda"), torch.float16) else "pad")
    with pytest.raises(ValueError, match="varlen attention needs"):
        resolve_attention("varlen", torch.device("cuda"), torch.float32)
    assert resolve_attention("fused", torch.device("cpu"), torch.float32) == "fused"
    assert CudaGraphs(enc, torch.device("cpu"), max_tokens=4096, max_batch=64, attention="fused").bucket(short) == (
        48, 4, 48, False)  # fused attention buckets as varlen does


@pytest.mark.parametrize("max_tokens, max_batch", [(16384, 256), (8192, 64), (2048, 100)])
def test_every_batch_lands_in_a_reachable_bucket(max_tokens, max_batch):
    """What the warm-up captures (reachable_keys) covers every batch the batcher can form: random batches of
    1..max_batch rows of 1..max_seq_length tokens within the token budget all map to one of those keys, and
    the enumeration is not padded with keys no batch reaches."""
    enc = Encoder(EncoderConfig.from_name("minilm-l6"))
    graphs = CudaGraphs(enc, torch.device("cpu"), max_tokens=max_tokens, max_batch=max_batch, attention="varlen")
    keys = set(graphs.reachable_keys())
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(3000):
        n = int(torch.randint(1, max_batch + 1, (1,), generator=gen))
        cap = int(torch.randint(1, enc.config.max_seq_length + 1, (1,), generator=gen))
        lengths = torch.randint(1, cap + 1, (n,), generator=gen).tolist()
        if int(torch.randint(0, 8, (1,), generator=gen)) == 0:  # now and then equal lengths (dense candidates)
            lengths = [lengths[0]] * len(lengths)
        while sum(lengths) > max_tokens:
            lengths.pop()
        if not lengths:
            continue
        key = graphs.bucket([[1] * k for k in lengths])
        assert key in keys, (len(lengths), sum(lengths), max(lengths), key)
        seen.add(key)
    for b in (1, 2, 16):  # exactly filled dense buckets, e.g. one input truncated at the model's 256 tokens
        for s in (16, 64, 256):
            if b * s <= max_tokens and b <= max_batch:
                key = graphs.bucket([[1] * s] * b)
                assert key == (b * s, b, s, True) and key in keys
    for t, b, s, dense in keys:
        assert b <= graphs.max_batch and (dense and b * s == t or not dense and s == min(graphs.max_seq, t))
    assert len(keys) <= 6 * len(graphs.tokens) + 64 and len(seen) > len(keys) // 4


def test_pending_buckets_come_in_order_of_need_and_stop_at_the_limits():
    """The start-up captures the first pending buckets before ready and the rest one at a time after (capture_next):
    single requests first, shortest first, then ever larger batches; never past max_graphs."""
    enc = Encoder(EncoderConfig.from_name("minilm-l6"))
    graphs = CudaGraphs(enc, torch.device("cpu"), max_tokens=8192, max_batch=64, attention="varlen")
    every = graphs.pending()
    assert sorted(every) == sorted(graphs.reachable_keys())
    singles = [k for k in every if k[1] == 1]
    assert every[: len(singles)] == singles and [k[0] for k in singles] == sorted(k[0] for k in singles)
    assert {k[0] for k in singles} >= {16, 128, 256}  # one request of any length MiniLM takes
    assert [k[1] for k in every] == sorted(k[1] for k in every)
    few = CudaGraphs(enc, torch.device("cpu"), max_tokens=8192, max_batch=64, attention="varlen", max_graphs=5)
    assert few.pending() == every[:5]


def test_a_bucket_traffic_keeps_missing_is_captured_first_or_on_the_spot(monkeypatch):
    """While the owner captures ahead (when idle), a batch without its graph runs eagerly; the buckets batches have
    missed come first in the capture order, and one missed CAPTURE_AFTER_MISSES times is captured on the spot (under
    traffic that never leaves the model idle it would otherwise run eagerly until the deferral ends)."""
    from fusedserve.model import graphs as graphs_module

    enc = Encoder(EncoderConfig.from_name("minilm-l6"))
    graphs = CudaGraphs(enc, torch.device("cpu"), max_tokens=8192, max_batch=64, attention="varlen")
    captured = []

    class Captured(Exception):
        pass

    def capture(key):
        captured.append(key)
        raise Captured  # what follows a capture needs a GPU; reaching it is the point

    monkeypatch.setattr(graphs, "_capture", capture)
    graphs.defer_captures_until = time.monotonic() + 60
    big = [[1] * 100] * 40
    key = graphs.bucket(big)
    assert graphs.pending()[0][1] == 1  # nothing missed yet: single requests first
    for _ in range(graphs_module.CAPTURE_AFTER_MISSES - 1):
        assert graphs.run(big) is None  # eager meanwhile
    assert graphs.pending()[0] == key and graphs.eager_fallbacks == graphs_module.CAPTURE_AFTER_MISSES - 1
    with pytest.raises(Captured):
        graphs.run(big)
    assert captured == [key]
    graphs.defer_captures_until = 0.0  # after the deferral every missing bucket is captured at once, as before
    with pytest.raises(Captured):
        graphs.run([[1] * 5])
