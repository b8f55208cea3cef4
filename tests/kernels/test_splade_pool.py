"""The Triton SPLADE pooling kernel (splade_pool) against the float64 reference: odd hidden and vocab widths in every
dtype, with and without a bias, one-token, empty and long sequences (several per token tile, and one across several
tiles), into a poisoned output; non-finite inputs, filler rows never read, strided inputs, every candidate
configuration, argument checks; the reference against the op's formula written out; the convention against
sentence-transformers' SpladePooling; and, on a GPU, the op inside a CUDA graph. On the GPU (`-m gpu`) or the
interpreter."""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from fusedserve.kernels import reference
from fusedserve.kernels.registry import SELF_TEST_COLS, SELF_TEST_ROWS
from fusedserve.kernels.testing import check_op, compare
from fusedserve.kernels.triton import splade_pool
from tests.conftest import INTERPRETER

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _ids(value) -> str:
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else str(value)


def _seed(*parts) -> int:
    return zlib.crc32("-".join(map(str, parts)).encode())


def _inputs(lengths, hidden: int, vocab: int, dtype: torch.dtype, device: str, seed: int, bias: bool = True,
            filler: int = 3, first: int = 0):
    """x [first + sum(lengths) + filler, hidden], weight [vocab, hidden], bias [vocab] (or None) and int32 offsets of
    `lengths` from row `first`, at the scales of spec._splade_pool_inputs (logits ~ N(-0.5, 1.25)). The rows before
    `first` and the filler rows after the last sequence are NaN: a kernel that reads them fails."""
    gen = torch.Generator().manual_seed(seed)
    real = sum(lengths)
    x = torch.randn(first + real + filler, hidden, generator=gen)
    x[:first] = float("nan")
    x[first + real:] = float("nan")
    weight = torch.randn(vocab, hidden, generator=gen) / hidden**0.5
    b = torch.randn(vocab, generator=gen) * 0.5 - 0.5
    cu = torch.tensor(list(itertools.accumulate(lengths, initial=first)), dtype=torch.int32)
    return x.to(device, dtype), weight.to(device, dtype), b.to(device, dtype) if bias else None, cu.to(device)


def _double(t):
    return None if t is None else (t.detach().cpu().double() if t.is_floating_point() else t.detach().cpu())


def _reference(x, weight, bias, cu):
    return reference.splade_pool(_double(x), _double(weight), _double(bias), _double(cu))


def _formula64(x, weight, bias, cu):
    """The op written out per sequence in float64: log1p(relu(logits)) of its rows, their max (0 for no rows)."""
    x, weight, bias = _double(x), _double(weight), _double(bias)
    offsets = cu.tolist()
    rows = []
    for start, end in zip(offsets[:-1], offsets[1:]):
        logits = x[start:end] @ weight.T + (0.0 if bias is None else bias)
        rows.append(torch.log1p(torch.relu(logits)).amax(0) if end > start
                    else torch.zeros(weight.shape[0], dtype=torch.float64))
    return torch.stack(rows) if rows else torch.zeros((0, weight.shape[0]), dtype=torch.float64)


def _poisoned(cu, vocab: int, device: str) -> torch.Tensor:
    return torch.full((cu.numel() - 1, vocab), float("nan"), dtype=torch.float32, device=device)


# (sequence lengths, hidden, vocab): a single token; several short sequences and an empty one inside one token tile;
# a long sequence across several token tiles (BLOCK_M 128 and 256) beside a one-token and an empty one; a deep
# reduction (13 BLOCK_K steps, a ragged last one) at a vocab just under a power of two; a wide vocab (17 tiles of
# 256, a one-column last tile) with an empty sequence first
SHAPES = [
    ([1], 7, 1),
    ([1, 0, 3, 2, 1], 67, 7),
    ([300, 1, 0, 70], 67, 300),
    ([5, 40], 769, 1023),
    ([0, 17, 9], 67, 4097),
]
# the three small shapes in every dtype, the bias present or not in turn (every dtype meets both); the two costly
# ones (on the interpreter, a program's cost is its tile's) in fewer: the deep one in fp32 and bf16, the wide one in
# fp16 (all five shapes run in every dtype on a GPU)
SWEEP = [(lengths, hidden, vocab, dtype, (n + d) % 2 == 0)
         for d, dtype in enumerate(DTYPES) for n, (lengths, hidden, vocab) in enumerate(SHAPES)
         if not INTERPRETER or n < 3 or (n, dtype) in ((3, torch.float32), (3, torch.bfloat16), (4, torch.float16))]


@pytest.mark.parametrize("lengths,hidden,vocab,dtype,bias", SWEEP, ids=_ids)
def test_matches_float64_reference(device, lengths, hidden, vocab, dtype, bias):
    x, weight, b, cu = _inputs(lengths, hidden, vocab, dtype, device, _seed(lengths, hidden, vocab, dtype, bias), bias)
    out = _poisoned(cu, vocab, device)  # every element must be written
    result = splade_pool.splade_pool(x, weight, b, cu, out=out)
    assert result.data_ptr() == out.data_ptr() and result.dtype == torch.float32
    expected = _reference(x, weight, b, cu)
    report = compare(result, expected, dtype)
    assert report.ok, report
    if expected.numel() > 20:  # neither all zero nor never zero: the max and relu's floor both exercised
        assert (expected > 0).any() and (expected == 0).any()
    for i, n in enumerate(lengths):
        if n == 0:
            assert (result[i] == 0).all()  # an empty sequence gives zeros


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_the_registrys_self_test_passes(device, dtype):
    """The registry's start-up check (kernels.testing.check_op) at its shapes: the spec's inputs (packed sequences, an
    empty one, NaN filler rows after them) into a NaN-poisoned output."""
    for rows, cols in itertools.product(SELF_TEST_ROWS, SELF_TEST_COLS):
        report = check_op(splade_pool.splade_pool, "splade_pool", rows, cols, dtype, device,
                          seed=_seed("self-test", rows, cols, dtype))
        assert report.ok, (rows, cols, report)


def test_the_reference_is_the_ops_formula():
    """The oracle (the reference in float64) against the op written out per sequence, and the reference at each
    dtype (its GEMM rounded to the dtype) within that dtype's tolerance of it."""
    for dtype in DTYPES:
        x, weight, b, cu = _inputs([4, 0, 1, 30], 67, 300, dtype, "cpu", _seed("formula", dtype))
        expected = _formula64(x, weight, b, cu)
        assert compare(_reference(x, weight, b, cu), expected, torch.float64).ok
        got = reference.splade_pool(x, weight, b, cu)
        assert got.dtype == torch.float32
        report = compare(got, expected, dtype)
        assert report.ok, (dtype, report)


def test_non_finite_inputs_propagate_like_the_reference(device):
    """A NaN in a sequence's row makes that sequence's output NaN; an infinite input gives +inf where its logit is
    +inf and leaves the columns where it is -inf (relu's 0) to the other rows; a NaN weight row makes its column NaN
    for every non-empty sequence; nothing else is touched. A NaN where the reference is finite never passes."""
    x, weight, b, cu = _inputs([5, 6, 0, 7, 4], 40, 70, torch.float32, device, seed=5)
    x[6, 7] = float("nan")  # sequence 1
    x[12, 0] = float("inf")  # sequence 3
    weight[33, 2] = float("nan")  # column 33
    got = splade_pool.splade_pool(x, weight, b, cu)
    expected = _reference(x, weight, b, cu)
    assert torch.isnan(got[1]).all() and torch.isinf(got[3]).any() and torch.isfinite(got[3, :33]).any()
    assert torch.isnan(got[[0, 3, 4], 33]).all() and got[2, 33] == 0  # the empty sequence stays 0
    report = compare(got, expected, torch.float32)
    assert report.ok, report
    got[4, 3] = float("nan")
    assert not compare(got, expected, torch.float32).ok


def test_rows_outside_the_offsets_are_never_read(device):
    """Rows before cu_seqlens[0] and after cu_seqlens[-1] are NaN (_inputs): no NaN may reach the output, and
    whole token tiles of filler (more filler rows than any BLOCK_M) change nothing."""
    for first, filler in ((3, 2), (0, 300), (260, 5)):
        x, weight, b, cu = _inputs([2, 9], 16, 40, torch.float16, device, _seed("filler", first, filler),
                                   first=first, filler=filler)
        got = splade_pool.splade_pool(x, weight, b, cu)
        assert torch.isfinite(got).all()
        report = compare(got, _formula64(x, weight, b, cu), torch.float16)
        assert report.ok, (first, filler, report)


def test_strided_inputs_and_int64_offsets(device):
    dtype = torch.float16
    x, weight, b, cu = _inputs([3, 8, 1], 48, 90, dtype, device, seed=11, filler=0)
    expected = _reference(x, weight, b, cu)
    wide = torch.full((x.shape[0], 100), float("nan"), dtype=dtype, device=device)
    wide[:, 20:68] = x
    strided = wide[:, 20:68]  # rows 100 apart: a slice of a wider buffer
    assert not strided.is_contiguous()
    bias_buffer = torch.stack([b, torch.full_like(b, float("nan"))], dim=1)
    for args in ((strided, weight, b, cu), (x.t().contiguous().t(), weight.t().contiguous().t(), b, cu),
                 (x, weight, bias_buffer[:, 0], cu.long())):
        report = compare(splade_pool.splade_pool(*args), expected, dtype)
        assert report.ok, report


def test_empty_batches_and_tokens(device):
    x, weight, b, cu = _inputs([2, 3], 16, 24, torch.float32, device, seed=1)
    assert splade_pool.splade_pool(x, weight, b, cu[:1]).shape == (0, 24)  # no sequences
    none = torch.zeros(3, dtype=torch.int32, device=device)  # two empty sequences, no rows read
    assert torch.equal(splade_pool.splade_pool(x, weight, b, none), torch.zeros(2, 24, device=device))
    out = torch.full((2, 24), float("nan"), device=device)
    splade_pool.splade_pool(x[:0], weight, b, none, out=out)  # no tokens at all
    assert torch.equal(out, torch.zeros(2, 24, device=device))


def test_a_second_call_into_the_same_output_gives_the_same_result(device):
    """The launcher zeroes the output before the kernel merges into it (and the autotuner's repeated launches merge
    the same values again): a second call into an output holding larger values gives the same result."""
    x, weight, b, cu = _inputs([7, 2], 32, 50, torch.float16, device, seed=2)
    first = splade_pool.splade_pool(x, weight, b, cu)
    out = torch.full_like(first, 100.0)
    assert torch.equal(splade_pool.splade_pool(x, weight, b, cu, out=out), first)


def test_bad_arguments_are_refused(device):
    x, weight, b, cu = _inputs([2, 2], 8, 16, torch.float32, device, seed=3)
    with pytest.raises(TypeError, match="share one of"):
        splade_pool.splade_pool(x.half(), weight, b, cu)
    with pytest.raises(TypeError, match="share one of"):
        splade_pool.splade_pool(x, weight, b.half(), cu)
    with pytest.raises(ValueError, match="do not fit"):
        splade_pool.splade_pool(x[:, :7], weight, b, cu)
    with pytest.raises(ValueError, match="do not fit"):
        splade_pool.splade_pool(x, weight, b[:15], cu)
    with pytest.raises(ValueError, match="do not fit"):
        splade_pool.splade_pool(x, weight[None], b, cu)
    with pytest.raises(ValueError, match=r"x must be \[tokens, hidden\]"):
        splade_pool.splade_pool(x[None], weight, b, cu)
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        splade_pool.splade_pool(x, weight, b, cu.float())
    with pytest.raises(ValueError, match="out must be"):
        splade_pool.splade_pool(x, weight, b, cu, out=torch.empty(2, 16, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match="out must be"):
        splade_pool.splade_pool(x, weight, b, cu, out=torch.empty(3, 16, device=device))
    with pytest.raises(ValueError, match="unsupported dtype"):
        splade_pool.splade_pool(x.int(), weight.int(), None, cu)


@pytest.mark.parametrize("dtype,bias", [(torch.float32, True), (torch.float16, False)], ids=_ids)
def test_every_candidate_config_computes_the_same_result(device, dtype, bias):
    """Each autotune candidate launched on its own (launch_config) matches the reference, whichever of them the
    autotuner would pick: sequences across several of the small candidates' token tiles and several inside one, a
    ragged vocab and hidden width."""
    x, weight, b, cu = _inputs([1, 70, 0, 3, 5, 2], 45, 70, dtype, device, _seed("configs", dtype, bias), bias)
    expected = _reference(x, weight, b, cu)
    configs = splade_pool.CONFIGS
    if device == "cuda":  # those that fit this GPU's shared memory, as the autotuner's pruning keeps them
        limit = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
        configs = splade_pool.configs_within(configs, x.element_size(), limit)
    for config in configs:
        out = _poisoned(cu, 70, device)
        splade_pool.launch_config(config, x, weight, b, cu, out)
        report = compare(out, expected, dtype)
        assert report.ok, (config, report)


def test_length_classes():
    """Short sequences (queries: under 64 tokens on average) and long ones are tuned apart."""
    assert [splade_pool.length_class(t, b) for t, b in ((16384, 2048), (4095, 64), (16384, 64), (16, 1), (5, 0))] == [
        0, 0, 1, 0, 0]


def test_configs_fit_hopper_in_half_precision():
    """Every candidate's pipelined tiles fit an H100/H200's shared memory in fp16/bf16, the default first; in fp32 the
    largest do not, and a smaller one leads."""
    h200 = 232448  # shared_memory_per_block_optin on Hopper
    assert splade_pool.configs_within(splade_pool.CONFIGS, 2, h200) == splade_pool.CONFIGS
    fp32 = splade_pool.configs_within(splade_pool.CONFIGS, 4, h200)
    assert splade_pool.CONFIGS[0] not in fp32 and fp32


@pytest.mark.slow  # importing sentence-transformers takes most of its time
def test_sentence_transformers_splade_pooling_convention(device):
    """sentence-transformers' SpladePooling (max, relu, eval mode) on the padded [batch, seq, vocab] logits with an
    attention mask, and on the flat logits with cu_seq_lens_q (its unpadded path), in float64, against the op on the
    packed layout."""
    st = pytest.importorskip("sentence_transformers")
    try:
        from sentence_transformers.sparse_encoder.modules import SpladePooling
    except ImportError:  # before 6.3 it lived in .models
        from sentence_transformers.sparse_encoder.models import SpladePooling
    lengths = [4, 1, 9, 6]
    x, weight, b, cu = _inputs(lengths, 24, 50, torch.float32, device, seed=13, filler=0)
    logits = _double(x) @ _double(weight).T + _double(b)  # [T, V]
    padded = torch.zeros(len(lengths), max(lengths), 50, dtype=torch.float64)
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, (start, n) in enumerate(zip(cu.tolist(), lengths)):
        padded[i, :n], mask[i, :n] = logits[start:start + n], 1
    pooling = SpladePooling(pooling_strategy="max", activation_function="relu").eval()
    with torch.no_grad():
        expected = pooling({"token_embeddings": padded, "attention_mask": mask})["sentence_embedding"]
    got = splade_pool.splade_pool(x, weight, b, cu)
    report = compare(got, expected, torch.float32)
    assert report.ok, (st.__version__, report)
    if hasattr(SpladePooling, "_forward_flattened"):  # the unpadded path (6.3 on)
        with torch.no_grad():
            flat = pooling({"token_embeddings": logits[None].clone(), "cu_seq_lens_q": cu.cpu().long()})
        report = compare(got, flat["sentence_embedding"], torch.float32)
        assert report.ok, (st.__version__, report)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["triton", "reference"])
def test_inside_a_cuda_graph_with_new_offsets(op):
    """Captured once, replayed with other offsets written into the same buffer (a graph bucket's next batch): the
    kernel and the reference read nothing on the host, so each replay gives that batch's result."""
    fn = splade_pool.splade_pool if op == "triton" else reference.splade_pool
    x, weight, b, cu = _inputs([40, 3, 0, 21], 64, 1000, torch.float16, "cuda", seed=21, filler=40)
    out = torch.empty(4, 1000, device="cuda")
    fn(x, weight, b, cu, out=out)  # compiles and autotunes outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(x, weight, b, cu, out=out)
    for offsets in ([0, 40, 43, 43, 64], [0, 1, 50, 90, 100], [5, 5, 5, 5, 5]):
        cu.copy_(torch.tensor(offsets, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        report = compare(out, _formula64(x, weight, b, cu), torch.float16)
        assert report.ok, (offsets, report)


@pytest.mark.gpu
def test_acceptance_shape_fits_where_the_logits_would_not_be_written():
    """64 sequences of 256 tokens at BERT's vocab and width in bf16: the op allocates only its output (the [16384,
    30522] logits it never writes would be 1 GB), and matches the float64 reference on a slice of the vocab."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(16384, 768, device="cuda", dtype=torch.bfloat16, generator=gen)
    weight = (torch.randn(30522, 768, device="cuda", generator=gen) / 768**0.5).to(torch.bfloat16)
    b = (torch.randn(30522, device="cuda", generator=gen) * 0.5 - 0.5).to(torch.bfloat16)
    cu = torch.arange(0, 16385, 256, device="cuda", dtype=torch.int32)
    splade_pool.splade_pool(x, weight, b, cu)  # autotuning
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = splade_pool.splade_pool(x, weight, b, cu)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before <= got.numel() * 4 + (1 << 20)
    cols = slice(30000, 30522)  # the ragged last vocab tiles
    expected = reference.splade_pool(x.double(), weight[cols].double(), b[cols].double(), cu)
    report = compare(got[:, cols], expected, torch.bfloat16)
    assert report.ok, report
