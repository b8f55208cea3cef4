"""The Triton BGE-M3 sparse kernel (m3_sparse) against the float64 reference: odd hidden widths in every dtype, many
sequences of lengths 0, 1, odd and long (several per token tile, and one across several tiles), repeated ids within
and across sequences, ties, dropped ids, filler rows poisoned with NaN, into a poisoned output: exactly the
reference's tokens kept, their weights within the kernel tolerance table (exact, on inputs whose weights are exact in
fp32); then inputs of any value against the per-(sequence, id) maxima, hand-computed ties, NaN and Inf, rows outside
the offsets never read, strided inputs, argument checks; the op's nonzeros against the dense scatter_reduce of
M3Head.sparse and FlagEmbedding's per-sentence dict; the kernels compiled for sm_90; and, on a GPU, the op inside a
CUDA graph. On the GPU (`-m gpu`) or the interpreter."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from fusedserve.kernels import reference
from fusedserve.kernels.registry import SELF_TEST_COLS, SELF_TEST_ROWS
from fusedserve.kernels.testing import check_op, compare
from fusedserve.kernels.triton import m3_sparse
from tests.conftest import DTYPES, INTERPRETER, ODD_COLS

ROOT = Path(__file__).resolve().parents[2]
DROPPED = (0, 1, 2, 3)  # XLM-R's <s>, <pad>, </s>, <unk>: BGE-M3's CLS, PAD, EOS and UNK
NAN = float("nan")


def _ids(value) -> str:
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else str(value)


def _seed(*parts) -> int:
    return zlib.crc32("-".join(map(str, parts)).encode())


def _inputs(lengths, hidden: int, dtype: torch.dtype, device: str, seed: int, *, exact: bool = True,
            vocab: int | None = None, first: int = 0, filler: int = 3, ties: float = 0.25):
    """(x [first + sum(lengths) + filler, hidden], weight [hidden], bias [1] float32, ids int32, offsets int32 of
    `lengths` from row `first`, dropped int32). Token ids from a small vocabulary (repeats within and across sequences),
    each sequence of two or more tokens between CLS (0) and EOS (2), a few UNK and PAD; a share `ties` of the tokens
    copy an earlier token of their sequence, row and id (equal weights). exact: values in 1/16ths, 1/256ths and
    1/4096ths as spec._m3_sparse_inputs draws them (every weight exact in fp32: the kept tokens are the reference's
    exactly, whatever the summation order), else of any value (x ~ N(0, 1.5^2), weight ~ N(0, 1/hidden)). The rows
    before `first` and the filler rows after the last sequence are NaN, with ids from the same vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    real = sum(lengths)
    rows = first + real + filler
    vocab = vocab or 4 + max(3, real // 5)
    if exact:
        x = (torch.randn(rows, hidden, generator=gen) * 24).round().clamp(-64, 64) / 16
        weight = (torch.randn(hidden, generator=gen) * 256 * hidden**-0.5).round().clamp(-255, 255) / 256
        bias = ((torch.randn(1, generator=gen) * 0.25 - 0.5) * 4096).round() / 4096
    else:
        x = torch.randn(rows, hidden, generator=gen) * 1.5
        weight = torch.randn(hidden, generator=gen) * hidden**-0.5
        bias = torch.randn(1, generator=gen) * 0.25 - 0.5
    ids = torch.randint(4, vocab, (rows,), generator=gen, dtype=torch.int32)
    ids[torch.rand(rows, generator=gen) < 0.05] = 3
    ids[torch.rand(rows, generator=gen) < 0.02] = 1
    cu = list(itertools.accumulate(lengths, initial=first))
    copy, pick = torch.rand(rows, generator=gen).tolist(), torch.rand(rows, generator=gen).tolist()
    for start, end in zip(cu[:-1], cu[1:]):
        for t in range(start + 1, end):
            if copy[t] < ties:
                source = start + int(pick[t] * (t - start))
                x[t], ids[t] = x[source], ids[source]
        if end - start > 1:
            ids[start], ids[end - 1] = 0, 2
    x[:first] = NAN
    x[first + real:] = NAN
    return (x.to(device, dtype), weight.to(device, dtype), bias.to(device), ids.to(device),
            torch.tensor(cu, dtype=torch.int32, device=device), torch.tensor(DROPPED, dtype=torch.int32, device=device))


def _double(t):
    return t.detach().cpu().double() if t.is_floating_point() else t.detach().cpu()


def _reference(*args):
    return reference.m3_sparse(*map(_double, args))


def _poisoned(x) -> torch.Tensor:
    return torch.full((x.shape[0],), NAN, dtype=torch.float32, device=x.device)


def _weights64(x, weight, bias):
    return (_double(x) @ _double(weight) + _double(bias)).clamp(min=0.0)


def _assert_exact(got, expected, dtype):
    """The same tokens kept (NaN ones included) and the same weights: within the dtype's tolerance, and here bit for
    bit, since the inputs make every weight exact in fp32."""
    got64 = got.detach().cpu().double()
    assert torch.equal(got64 != 0, expected != 0), torch.nonzero((got64 != 0) != (expected != 0)).flatten()
    report = compare(got, expected, dtype)
    assert report.ok, report
    torch.testing.assert_close(got64, expected, rtol=0, atol=0, equal_nan=True)


# (sequence lengths, hidden): a single token; several short sequences and empty ones inside one token tile; a long
# sequence across several token tiles and key blocks beside a one-token and an empty one; odd lengths at a width
# just over a power of two; a long and a short one; an empty one first at a width of 4097; 61 sequences of 0-9
# tokens (a binary search over many offsets, dozens of sequences in a tile)
LENGTHS = {
    1: [1],
    7: [1, 0, 3, 2, 1, 5, 0],
    300: [300, 1, 0, 70],
    769: [5, 0, 41, 17],
    1023: [130, 3],
    4097: [0, 17, 9, 64],
}
MANY = [int(n) for n in torch.randint(0, 10, (61,), generator=torch.Generator().manual_seed(8))]
# every odd width in every dtype; on the interpreter the widest two in fp32 and one half dtype each
SWEEP = [(LENGTHS[hidden], hidden, dtype) for hidden in ODD_COLS for dtype in DTYPES
         if not INTERPRETER or hidden < 1023 or dtype in (torch.float32, {1023: torch.bfloat16}.get(hidden,
                                                                                                    torch.float16))]
SWEEP += [(MANY, hidden, dtype) for hidden, dtype in ((7, torch.float32), (300, torch.bfloat16), (769, torch.float16))]


@pytest.mark.parametrize("lengths,hidden,dtype", SWEEP, ids=lambda v: _ids(v) if not isinstance(v, list) else
                         f"{len(v)}seqs")
def test_matches_float64_reference(device, lengths, hidden, dtype):
    args = _inputs(lengths, hidden, dtype, device, _seed(lengths, hidden, dtype))
    out = _poisoned(args[0])  # every element must be written, filler rows included
    result = m3_sparse.m3_sparse(*args, out=out)
    assert result.data_ptr() == out.data_ptr() and result.dtype == torch.float32
    expected = _reference(*args)
    _assert_exact(result, expected, dtype)
    x, weight, bias, ids, cu, _ = args
    real = slice(int(cu[0]), int(cu[-1]))
    w = _weights64(x, weight, bias)[real]
    if sum(lengths) > 20:  # what the inputs exercise: kept weights, relu's zeros, ties, dropped tokens of weight > 0
        kept = expected[real] > 0
        assert kept.any() and (w == 0).any()
        assert (w[~kept] > 0).any()  # tokens of positive weight not kept: outranked or dropped
        dropped = torch.isin(ids[real].cpu(), torch.tensor(DROPPED))
        assert (w[dropped] > 0).any()
        seq, token = _sequence_of_tokens(cu, x.shape[0])[real], ids[real].cpu()
        tied = (seq[:, None] == seq[None, :]) & (token[:, None] == token[None, :]) & (w[:, None] == w[None, :])
        tied &= (w > 0)[:, None] & ~torch.eye(len(w), dtype=torch.bool)
        assert tied.any()  # two tokens of a group with equal positive weights: the lower index kept, if either is
    for i, n in enumerate(lengths):
        if n == 1 and int(ids[int(cu[i])]) not in DROPPED:  # a lone token is its group
            t = int(cu[i])
            assert float(result[t]) == float(_weights64(x[t:t + 1], weight, bias)[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_inputs_of_any_value_keep_each_groups_maximum(device, dtype):
    """Weights of any value (not exact in fp32): the kernel's summation order may rank two tokens whose weights are
    within rounding of each other otherwise than the float64 reference does, so the check is per (sequence, id): at
    most one token kept, and the kept weights, scattered into the dense [sequences, vocabulary], within the dtype's
    tolerance of the reference's (which equal the float64 maxima of the group)."""
    lengths = [40, 1, 0, 97, 13]
    args = _inputs(lengths, 300, dtype, device, _seed("any", dtype), exact=False, ties=0.1)
    got = m3_sparse.m3_sparse(*args, out=_poisoned(args[0]))
    expected = _reference(*args)
    _, _, _, ids, cu, dropped = args
    vocab = int(ids.max()) + 1
    counts = _dense((got != 0).double(), ids, cu, vocab, reduce="sum")
    assert counts.max() <= 1 and counts.sum() > 20
    report = compare(_dense(got, ids, cu, vocab), _dense(expected, ids, cu, vocab), dtype)
    assert report.ok, report
    dense = _m3_head_sparse(*map(_double, args), vocab)
    assert compare(_dense(expected, ids, cu, vocab), dense, torch.float64).ok


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_the_registrys_self_test_passes(device, dtype):
    """The registry's start-up check (kernels.testing.check_op) at its shapes: the spec's inputs (packed sequences,
    empty ones, ties, dropped ids, NaN filler rows after them) into a NaN-poisoned output."""
    for rows, cols in itertools.product(SELF_TEST_ROWS, SELF_TEST_COLS):
        report = check_op(m3_sparse.m3_sparse, "m3_sparse", rows, cols, dtype, device,
                          seed=_seed("self-test", rows, cols, dtype))
        assert report.ok, (rows, cols, report)


def _hand_case(device):
    """hidden 1, x the weights themselves (weight 1, bias 0): three sequences, then one filler row."""
    #                     seq 0: [0, 6)                     seq 1: [6, 6)  seq 2: [6, 10)      filler
    x = torch.tensor([0.5, 2.0, 3.0, 3.0, 1.0, 9.0, 3.0, -1.0, 3.0, -2.0, NAN])
    ids = torch.tensor([0, 5, 5, 5, 7, 2, 5, 7, 7, 9, 5], dtype=torch.int32)
    cu = torch.tensor([0, 6, 6, 10], dtype=torch.int32)
    return (x[:, None].to(device), torch.ones(1, device=device), torch.zeros(1, device=device), ids.to(device),
            cu.to(device), torch.tensor([0, 2], dtype=torch.int32, device=device))


def test_hand_computed_ties_and_dropped_ids(device):
    """Sequence 0: CLS (dropped) 0.5, id 5 at 2, 3, 3 (the first 3 kept), id 7 at 1, EOS (dropped) 9; sequence 1
    empty; sequence 2: id 5 again (its own group: kept), id 7 at relu(-1) = 0 then 3 (the 3 kept), id 9 at relu(-2)
    = 0 (kept with weight 0: zero either way); the filler row is NaN and unread. The reference agrees."""
    args = _hand_case(device)
    want = torch.tensor([0.0, 0.0, 3.0, 0.0, 1.0, 0.0, 3.0, 0.0, 3.0, 0.0, 0.0])
    for name, fn in (("triton", m3_sparse.m3_sparse), ("reference", reference.m3_sparse)):
        got = fn(*args)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, msg=name)


def test_non_finite_weights_propagate_like_the_reference(device):
    """A NaN weight outranks every number of its group: that token keeps NaN (the first NaN of the group if several),
    the group's others give 0, so each sequence's dense form holds NaN at that id, as M3Head.sparse's scatter amax
    gives; +inf outranks every finite weight; a NaN or Inf in a dropped token's row is never read. A NaN where the
    reference is finite never passes."""
    x, weight, bias, ids, cu, dropped = _hand_case(device)
    x = x.clone()
    x[3, 0], x[1, 0] = NAN, NAN  # id 5 of sequence 0: NaN at 1 and 3 (1 kept), 3.0 at 2 -> 0
    x[8, 0] = float("inf")  # id 7 of sequence 2: +inf kept
    x[5, 0] = NAN  # EOS: dropped, unread
    got = m3_sparse.m3_sparse(x, weight, bias, ids, cu, dropped)
    expected = _reference(x, weight, bias, ids, cu, dropped)
    assert torch.isnan(got[1]) and got[2] == 0 and got[3] == 0 and got[4] == 1.0 and got[5] == 0
    assert got[8] == float("inf") and got[6] == 3.0
    report = compare(got, expected, torch.float32)
    assert report.ok, report
    dense = _m3_head_sparse(*map(_double, (x, weight, bias, ids, cu, dropped)), 10)
    assert torch.isnan(dense[0, 5]) and dense[2, 7] == float("inf")
    torch.testing.assert_close(_dense(got, ids, cu, 10), dense, rtol=0, atol=0, equal_nan=True)
    # a NaN weight vector: every kept token NaN (and the dropped ones still 0)
    nan_weight = m3_sparse.m3_sparse(x, torch.full_like(weight, NAN), bias, ids, cu, dropped)
    assert compare(nan_weight, _reference(x, torch.full_like(weight, NAN), bias, ids, cu, dropped), torch.float32).ok
    assert torch.isnan(nan_weight[[1, 4, 6, 7, 9]]).all() and (nan_weight[[0, 2, 3, 5, 8, 10]] == 0).all()
    got[4] = NAN
    assert not compare(got, expected, torch.float32).ok


def test_rows_outside_the_offsets_are_never_read(device):
    """Rows before cu_seqlens[0] and after cu_seqlens[-1] are NaN with ids of the real tokens' vocabulary: no NaN may
    reach the output, nor may they outrank a real token; whole token tiles of filler (more filler rows than a tile)
    change nothing."""
    for first, filler in ((3, 2), (0, 300), (130, 5)):
        args = _inputs([2, 9, 0, 33], 16, torch.float16, device, _seed("filler", first, filler), first=first,
                       filler=filler, vocab=8)
        got = m3_sparse.m3_sparse(*args, out=_poisoned(args[0]))
        assert torch.isfinite(got).all() and (got[:first] == 0).all() and (got[first + 44:] == 0).all()
        _assert_exact(got, _reference(*args), torch.float16)


def test_strided_inputs_int64_ids_and_offsets_and_no_dropped_ids(device):
    dtype = torch.bfloat16
    x, weight, bias, ids, cu, dropped = _inputs([3, 8, 1, 20], 48, dtype, device, seed=11, filler=0)
    expected = _reference(x, weight, bias, ids, cu, dropped)
    wide = torch.full((x.shape[0], 100), NAN, dtype=dtype, device=device)
    wide[:, 20:68] = x
    strided = wide[:, 20:68]  # rows 100 apart: a slice of a wider buffer
    assert not strided.is_contiguous()
    weights = torch.stack([weight, torch.full_like(weight, NAN)], dim=1)[:, 0]  # a stride of 2
    for args in ((strided, weight, bias, ids, cu, dropped), (x.t().contiguous().t(), weights, bias, ids, cu, dropped),
                 (x, weight, bias, ids.long(), cu.long(), dropped.long())):
        _assert_exact(m3_sparse.m3_sparse(*args), expected, dtype)
    none = dropped[:0]  # no dropped ids: CLS, EOS and the others compete as any id
    got = m3_sparse.m3_sparse(x, weight, bias, ids, cu, none)
    _assert_exact(got, _reference(x, weight, bias, ids, cu, none), dtype)
    assert (got[torch.isin(ids.cpu(), torch.tensor(DROPPED)).to(device)] > 0).any()


def test_offsets_are_clamped_to_the_rows(device):
    x, weight, bias, ids, _, dropped = _inputs([4, 6], 16, torch.float32, device, seed=12, filler=0)
    for offsets in ([-4, 4, 10], [0, 4, 99], [-1, -1, 3]):
        cu = torch.tensor(offsets, dtype=torch.int64, device=device)
        _assert_exact(m3_sparse.m3_sparse(x, weight, bias, ids, cu, dropped),
                      _reference(x, weight, bias, ids, cu, dropped), torch.float32)


def test_empty_batches_and_tokens(device):
    x, weight, bias, ids, cu, dropped = _inputs([2, 3], 16, torch.float32, device, seed=1)
    for offsets in (cu[:1], torch.zeros(3, dtype=torch.int32, device=device)):  # no sequences; two empty ones
        out = _poisoned(x)
        assert torch.equal(m3_sparse.m3_sparse(x, weight, bias, ids, offsets, dropped, out=out),
                           torch.zeros(x.shape[0], device=device))
    none = torch.zeros(3, dtype=torch.int32, device=device)
    assert m3_sparse.m3_sparse(x[:0], weight, bias, ids[:0], none, dropped).shape == (0,)  # no tokens at all


def test_a_second_call_into_the_same_output_gives_the_same_result(device):
    args = _inputs([7, 2, 30], 32, torch.float16, device, seed=2)
    first = m3_sparse.m3_sparse(*args)
    out = torch.full_like(first, 100.0)
    assert torch.equal(m3_sparse.m3_sparse(*args, out=out), first)


def test_bad_arguments_are_refused(device):
    x, weight, bias, ids, cu, dropped = _inputs([2, 2], 8, torch.float32, device, seed=3)
    with pytest.raises(TypeError, match="must share one of"):
        m3_sparse.m3_sparse(x.half(), weight, bias, ids, cu, dropped)
    with pytest.raises(TypeError, match="bias be float32"):
        m3_sparse.m3_sparse(x.half(), weight.half(), bias.half(), ids, cu, dropped)
    with pytest.raises(ValueError, match="do not fit"):
        m3_sparse.m3_sparse(x[:, :7], weight, bias, ids, cu, dropped)
    with pytest.raises(ValueError, match="do not fit"):
        m3_sparse.m3_sparse(x, weight[None], bias, ids, cu, dropped)
    with pytest.raises(ValueError, match="do not fit"):
        m3_sparse.m3_sparse(x, weight, torch.zeros(2, device=device), ids, cu, dropped)
    with pytest.raises(ValueError, match=r"x must be \[tokens, hidden\]"):
        m3_sparse.m3_sparse(x[None], weight, bias, ids, cu, dropped)
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        m3_sparse.m3_sparse(x, weight, bias, ids, cu.float(), dropped)
    with pytest.raises(ValueError, match="ids must be"):
        m3_sparse.m3_sparse(x, weight, bias, ids[:3], cu, dropped)
    with pytest.raises(ValueError, match="ids must be"):
        m3_sparse.m3_sparse(x, weight, bias, ids.float(), cu, dropped)
    with pytest.raises(ValueError, match="dropped must be"):
        m3_sparse.m3_sparse(x, weight, bias, ids, cu, dropped[None])
    with pytest.raises(ValueError, match="out must be"):
        m3_sparse.m3_sparse(x, weight, bias, ids, cu, dropped, out=torch.empty(x.shape[0], 1, device=device))
    with pytest.raises(ValueError, match="out must be"):
        m3_sparse.m3_sparse(x, weight, bias, ids, cu, dropped,
                            out=torch.empty(x.shape[0], dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match="unsupported dtype"):
        m3_sparse.m3_sparse(x.int(), weight.int(), bias, ids, cu, dropped)


# ---- the dense formulations the op replaces ---------------------------------------------------------------------

def _sequence_of_tokens(cu, tokens: int) -> torch.Tensor:
    """Each token's sequence, B for tokens outside the offsets."""
    cu = cu.cpu().long()
    rows = torch.arange(tokens)
    seq = torch.searchsorted(cu[1:], rows, right=True)
    return torch.where((rows >= cu[0]) & (rows < cu[-1]), seq, cu.numel() - 1)


def _dense(per_token, ids, cu, vocab: int, reduce: str = "amax") -> torch.Tensor:
    """The op's per-token output scattered into [B, vocab] by (sequence, id) (at most one nonzero per pair: amax is
    that value, NaN included), float64."""
    values = per_token.detach().cpu().double()
    seq = _sequence_of_tokens(cu, values.shape[0])
    segments = cu.numel() - 1
    dense = torch.zeros((segments + 1) * vocab, dtype=torch.float64)
    dense.scatter_reduce_(0, seq * vocab + ids.cpu().long(), values, reduce)
    return dense.view(segments + 1, vocab)[:segments]


def _m3_head_sparse(x, weight, bias, ids, cu, dropped, vocab: int) -> torch.Tensor:
    """M3Head.sparse's formulation (FlagEmbedding's M3Embedder, dense): relu(linear) per token, each sequence's
    largest weight per id by scatter_reduce amax into a zeroed [B, vocab], the dropped ids' columns zeroed."""
    seq = _sequence_of_tokens(cu, x.shape[0])
    real = seq < cu.numel() - 1
    weights = torch.relu(torch.nn.functional.linear(x[real], weight[None], bias)).squeeze(-1)
    out = torch.zeros((cu.numel() - 1) * vocab, dtype=weights.dtype)
    out.scatter_reduce_(0, seq[real] * vocab + ids[real].long(), weights, "amax")
    out = out.view(cu.numel() - 1, vocab)
    out[:, [i for i in dropped.tolist() if 0 <= i < vocab]] = 0.0
    return out


def _flag_embedding_dicts(x, weight, bias, ids, cu, dropped) -> list[dict[int, float]]:
    """M3Embedder._process_token_weights per sentence: {id: weight} of the ids not dropped whose weight is > 0, each
    the largest of its id."""
    weights = torch.relu(x @ weight + bias)
    offsets, unused = cu.tolist(), set(dropped.tolist())
    dicts = []
    for start, end in zip(offsets[:-1], offsets[1:]):
        result: dict[int, float] = {}
        for w, idx in zip(weights[start:end].tolist(), ids[start:end].tolist()):
            if idx not in unused and w > 0 and w > result.get(idx, 0):
                result[idx] = w
        dicts.append(result)
    return dicts


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_nonzeros_are_the_dense_scatter_and_flag_embeddings_dicts(device, dtype):
    """Each sequence's nonzeros of the op, as {id: weight}, are FlagEmbedding's sparse dict, and scattered into
    [sequences, vocabulary] they are M3Head.sparse's dense scatter_reduce, bit for bit (the float64 weights of the
    same rounded inputs, exact in fp32 here); many sequences, empty and one-token ones among them."""
    args = _inputs([1, 0, 9, 40, 2, 0, 75, 3, 16], 300, dtype, device, _seed("dense", dtype), vocab=100)
    got = m3_sparse.m3_sparse(*args)
    x64 = list(map(_double, args))
    ids, cu = x64[3], x64[4]
    vocab = int(ids.max()) + 1
    torch.testing.assert_close(_dense(got, ids, cu, vocab), _m3_head_sparse(*x64, vocab), rtol=0, atol=0)
    offsets = cu.tolist()
    ours = [{int(ids[t]): float(got[t]) for t in range(start, end) if got[t] != 0}
            for start, end in zip(offsets[:-1], offsets[1:])]
    assert ours == _flag_embedding_dicts(*x64)
    assert sum(map(len, ours)) > 10


def test_the_bench_formulation_is_the_dense_form():
    """bench kernels m3-sparse's eager provider (relu(linear), scatter_reduce amax into a zeroed [B, V], specials
    zeroed: the FlagEmbedding formulation the op is timed against) is M3Head.sparse's dense form, filler rows aside."""
    from bench import kernels as suite

    args = _inputs([5, 0, 13, 1], 24, torch.float32, "cpu", seed=31)
    vocab = int(args[3].max()) + 1
    dense = suite.dense_m3_sparse(*args, vocab=vocab)
    torch.testing.assert_close(dense.double(), _m3_head_sparse(*map(_double, args), vocab), rtol=0, atol=0)
    torch.testing.assert_close(_dense(reference.m3_sparse(*args), args[3], args[4], vocab), dense.double(), rtol=0,
                               atol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels are compiled for real by the GPU tests")
@pytest.mark.slow
def test_the_kernels_compile_for_sm90(tmp_path):
    """Triton's compiler and its own ptxas (no nvcc), for Hopper, on a machine without a GPU: both kernels in each
    dtype and with programmatic dependent launch (its wait before the first load: compile_check._check_pdl_ptx),
    the selection kernel's runtime branch included (the interpreter never compiles it)."""
    script = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fusedserve.kernels.triton.compile_check import _check_pdl_ptx, _signature
from fusedserve.kernels.triton.m3_sparse import _m3_keys_kernel, _m3_select_kernel, BLOCK_J, SELECT_ROWS

target = GPUTarget("cuda", 90, 32)
i32 = "i32"
for ptr in ("*fp16", "*bf16", "*fp32"):
    for pdl in (False, True):
        keys = {"x_ptr": ptr, "w_ptr": ptr, "b_ptr": "*fp32", "ids_ptr": "*i32", "cu_ptr": "*i32", "drop_ptr": "*i32",
                "key_ptr": "*i32", "T": i32, "H": i32, "B": i32, "K": i32, "stride_xt": i32, "stride_xh": i32,
                "stride_w": i32}
        select = {"ids_ptr": "*i64", "key_ptr": "*i32", "cu_ptr": "*i64", "y_ptr": "*fp32", "T": i32, "B": i32,
                  "STEPS": i32}
        for fn, types, constexprs in ((_m3_keys_kernel, keys, {"BLOCK_T": 32, "BLOCK_H": 256}),
                                      (_m3_select_kernel, select, {"BLOCK_T": SELECT_ROWS, "BLOCK_J": BLOCK_J})):
            constexprs = {**constexprs, "USE_PDL": pdl}
            source = ASTSource(fn=fn, signature=_signature(fn, types, constexprs), constexprs=constexprs)
            kernel = triton.compile(source, target=target, options={"num_warps": 4, "launch_pdl": pdl})
            if pdl:
                _check_pdl_ptx(kernel.asm["ptx"])
            print("ok", fn.__name__, ptr, pdl)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert result.stdout.count("ok ") == 12, result.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["triton", "reference"])
def test_inside_a_cuda_graph_with_new_offsets_and_ids(op):
    """Captured once, replayed with other offsets and ids written into the same buffers (a graph bucket's next
    batch): the kernels and the reference read nothing on the host, so each replay gives that batch's result."""
    fn = m3_sparse.m3_sparse if op == "triton" else reference.m3_sparse
    x, weight, bias, ids, cu, dropped = _inputs([40, 3, 0, 21], 64, torch.float16, "cuda", seed=21, filler=40)
    out = torch.empty(x.shape[0], device="cuda")
    fn(x, weight, bias, ids, cu, dropped, out=out)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(x, weight, bias, ids, cu, dropped, out=out)
    gen = torch.Generator().manual_seed(5)
    for offsets in ([0, 40, 43, 43, 64], [0, 1, 50, 90, 100], [5, 5, 5, 5, 5]):
        cu.copy_(torch.tensor(offsets, dtype=torch.int32))
        ids.copy_(torch.randint(0, 12, ids.shape, generator=gen, dtype=torch.int32))
        out.fill_(NAN)
        graph.replay()
        _assert_exact(out, _reference(x, weight, bias, ids, cu, dropped), torch.float16)
