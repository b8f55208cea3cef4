"""relative_attention (attention over packed sequences with MPNet's relative position bias) beyond the generic sweeps:
against the ops' formula written out in float64 (tests/kernels/_shared.py: a loop over sequences and heads with the
bias matrix built entry by entry), on odd head widths, single tokens, long sequences over several query and key
blocks, empty filler sequences and filler rows; tiles of every shape the kernel's distance strip must handle; NaN;
heads too wide for the kernel; clear errors; and the bias table's convention, against transformers' own MPNet
attention. Triton runs on the interpreter here (and on the GPU with -m gpu); the CUDA backend does not implement it."""

from __future__ import annotations

import itertools

import pytest
import torch

from fusedserve.kernels import reference
from fusedserve.kernels.testing import compare
from fusedserve.kernels.triton import LAUNCHERS
from fusedserve.kernels.triton.relative_attention import launch_shape
from tests.conftest import INTERPRETER
from tests.kernels._shared import dyadic, formula_float64, packed_qkv

NAN = float("nan")
OP = "relative_attention"
# the interpreter's bf16 runs the fp32 path (see test_triton_ops.FP32_ON_THE_INTERPRETER); the GPU runs all three
DTYPES = (torch.float32, torch.float16) if INTERPRETER else (torch.float32, torch.float16, torch.bfloat16)


def _launch():
    return LAUNCHERS[OP]


def _inputs(lengths, hidden, heads, dtype, device, filler=0, reach=None, seed=0, first=0):
    """qkv [first + sum(lengths) + filler, 3 * hidden] of order 1 (rows before `first` and the filler rows are NaN:
    never to be read), offsets from `first`, and a bias table of order 1 reaching `reach` (default: the longest
    sequence, the least the op takes) in float32, as the model keeps it."""
    gen = torch.Generator().manual_seed(seed)
    qkv, cu = packed_qkv(lengths, hidden, gen, first, filler)
    reach = reach or max(max(lengths), 1)
    bias = torch.randn(heads, 2 * reach - 1, generator=gen)
    return qkv.to(device, dtype), cu.to(device), bias.to(device)


def _check(out, qkv, cu, max_seqlen, heads, bias, dtype, first=0):
    """Every row against the formula in float64: the sequences' rows within the dtype's tolerance, every other row
    exactly zero."""
    begin, end = first, int(cu[-1])
    expected = formula_float64(OP, (qkv[begin:end], cu - begin, max_seqlen, heads, bias), {})
    report = compare(out[begin:end], expected, dtype)
    assert report.ok, report
    outside = torch.cat([out[:begin], out[end:]])
    assert torch.equal(outside, torch.zeros_like(outside)), "rows outside the sequences must be zeros"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lengths,hidden,heads", [
    ([1], 64, 1),                                    # a single token: its own value
    ([7], 14, 2),                                    # heads of 7 columns (padded to 16)
    ([300], 64, 2),                                  # 128-query blocks, 64-key steps, a partial last key block
    ([5, 0, 130, 1, 64, 33, 0, 0], 93, 1),           # a mix, empty sequences between and after, a head of 93
    ([40, 17, 0], 64, 2),                            # square blocks of the bound (64)
    ([9, 30, 2, 17], 96, 3),                         # heads of 32
])
def test_matches_the_formula(device, dtype, lengths, hidden, heads):
    qkv, cu, bias = _inputs(lengths, hidden, heads, dtype, device, filler=11, seed=len(lengths) + hidden)
    max_seqlen = max(lengths)
    out = torch.full((qkv.shape[0], hidden), NAN, dtype=dtype, device=device)
    assert _launch()(qkv, cu, max_seqlen, heads, bias, out=out).data_ptr() == out.data_ptr()
    _check(out, qkv, cu, max_seqlen, heads, bias, dtype)


def test_a_loose_bound_and_a_longer_table(device):
    """max_seqlen far above the real lengths (a graph bucket's), a table reaching past it (the model's is sized by
    its positions), and rows before the first offset: zeros like the filler past the last."""
    qkv, cu, bias = _inputs([3, 20, 0, 11], 64, 2, torch.float16, device, filler=5, reach=514, seed=3, first=4)
    out = torch.full((qkv.shape[0], 64), NAN, dtype=torch.float16, device=device)
    _launch()(qkv, cu, 512, 2, bias, out=out)
    _check(out, qkv, cu, 512, 2, bias, torch.float16, first=4)


@pytest.mark.parametrize("block_m,block_n", [(16, 32), (32, 16), (64, 16), (16, 64)])
def test_every_tile_shape_reads_the_right_diagonals(device, monkeypatch, block_m, block_n):
    """The distance strip of a tile is BLOCK_M + BLOCK_N - 1 entries rounded up to a power of two; rectangular tiles
    either way round, over several query and key blocks with a partial last one, must place each diagonal right."""
    shape = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": 32, "num_warps": 4, "num_stages": 2}
    monkeypatch.setattr("fusedserve.kernels.triton.relative_attention.launch_shape", lambda *args: dict(shape))
    qkv, cu, bias = _inputs([70, 45, 1], 64, 2, torch.float32, device, filler=3, reach=80, seed=block_m + block_n)
    out = torch.full((qkv.shape[0], 64), NAN, device=device)
    _launch()(qkv, cu, 70, 2, bias, out=out)
    _check(out, qkv, cu, 70, 2, bias, torch.float32)


def test_nan_propagates_within_its_sequence_and_head_only(device):
    """A NaN in one value element reaches exactly its column of its sequence (as in the formula), never another
    sequence, head or the filler rows; the NaN rows outside the sequences are never read. A result left NaN where
    the formula has a number fails the comparison."""
    qkv, cu, bias = _inputs([6, 9, 4], 32, 2, torch.float32, device, filler=4, seed=5)
    qkv[8, 2 * 32 + 16 + 3] = NAN  # sequence 1, head 1, value column 3
    out = _launch()(qkv, cu, 9, 2, bias)
    _check(out, qkv, cu, 9, 2, bias, torch.float32)
    assert torch.isnan(out[6:15, 16 + 3]).all() and torch.isnan(out).sum() == 9
    out[0, 0] = NAN
    assert not compare(out[:19], formula_float64(OP, (qkv[:19], cu, 9, 2, bias), {}), torch.float32).ok


def test_heads_too_wide_for_the_kernel_run_the_torch_path(device):
    qkv, cu, bias = _inputs([3, 4], 160, 1, torch.float32, device, filler=2, seed=2)  # one head of 160 > 128
    out = torch.full((qkv.shape[0], 160), NAN, device=device)
    assert _launch()(qkv, cu, 4, 1, bias, out=out).data_ptr() == out.data_ptr()
    _check(out, qkv, cu, 4, 1, bias, torch.float32)


def test_bad_arguments_raise_clear_errors(device):
    launch = _launch()
    qkv, cu, bias = _inputs([3, 4], 64, 4, torch.float32, device)
    with pytest.raises(ValueError, match="past the bias table's reach 4"):
        launch(qkv, cu, 5, 4, bias)
    with pytest.raises(ValueError, match="past the bias table's reach 4"):
        reference.relative_attention(qkv, cu, 5, 4, bias)
    with pytest.raises(ValueError, match="must be \\[T, 3H\\]"):
        launch(qkv[:, 1:], cu, 4, 4, bias)
    with pytest.raises(ValueError, match="5 heads do not split 64"):
        launch(qkv, cu, 4, 5, bias)
    with pytest.raises(ValueError, match="bias must be"):
        launch(qkv, cu, 4, 4, bias[:, 1:])
    with pytest.raises(ValueError, match="bias must be"):
        launch(qkv, cu, 4, 4, bias[:2])
    with pytest.raises(TypeError, match="qkv must be one of"):
        launch(qkv.double(), cu, 4, 4, bias)
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        launch(qkv, cu.float(), 4, 4, bias)
    with pytest.raises(ValueError, match="out must be"):
        launch(qkv, cu, 4, 4, bias, out=torch.empty(7, 192, device=device))


def test_launch_shapes_hold_the_kernels_limits():
    """Square blocks of the bound for short sequences, 64 keys a step past 64 tokens, 128 queries from 256 on,
    32 x 32 at most for fp32; every block at least tl.dot's 16, BLOCK_D a power of two holding the head."""
    assert launch_shape(16, 64) == {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_D": 64, "num_warps": 4,
                                           "num_stages": 2}
    assert launch_shape(128, 64)["BLOCK_M"] == 64 and launch_shape(512, 64)["BLOCK_M"] == 128
    for max_seqlen, head_dim, ieee in itertools.product((1, 7, 33, 64, 65, 255, 256, 512), (7, 32, 64, 93, 128),
                                                        (False, True)):
        shape = launch_shape(max_seqlen, head_dim, ieee)
        assert min(shape["BLOCK_M"], shape["BLOCK_N"]) >= 16 and shape["BLOCK_D"] >= head_dim
        assert shape["BLOCK_D"] & (shape["BLOCK_D"] - 1) == 0
        assert not ieee or max(shape["BLOCK_M"], shape["BLOCK_N"]) <= 32


# ---- the bias table's convention, against transformers' MPNet -----------------------------------------------------


def test_the_table_convention_matches_transformers_mpnet(device):
    """B[h, r] = relative_attention_bias(bucket(r))[h] for r = j - i (transformers' relative_position =
    memory_position - context_position) at column r + R - 1: the op on a packed batch equals MPNetSelfAttention with
    MPNetEncoder.compute_position_bias on the same batch padded, over distances past the exact buckets (8) and past
    the saturating one (128)."""
    mpnet = pytest.importorskip("transformers.models.mpnet.modeling_mpnet")
    from transformers import MPNetConfig

    hidden, heads, lengths = 32, 2, [150, 37, 1]
    config = MPNetConfig(hidden_size=hidden, num_attention_heads=heads, num_hidden_layers=1, intermediate_size=64,
                         relative_attention_num_buckets=32, attention_probs_dropout_prob=0.0)
    gen = torch.Generator().manual_seed(11)
    encoder = mpnet.MPNetEncoder(config).double().eval()
    attention = mpnet.MPNetSelfAttention(config).double().eval()
    with torch.no_grad():
        # float32 values throughout, so the op's float32 inputs are exactly transformers' float64 ones
        encoder.relative_attention_bias.weight.copy_(dyadic(gen, (32, heads), 1 / 64, 2.0))
        for linear in (attention.q, attention.k, attention.v):
            linear.weight.copy_(dyadic(gen, (hidden, hidden), 1 / 64, 0.25))
            linear.bias.copy_(dyadic(gen, (hidden,), 1 / 64, 0.5))
        attention.o.weight.copy_(torch.eye(hidden, dtype=torch.float64))  # c itself, not o(c)
        attention.o.bias.zero_()
        batch, seq = len(lengths), max(lengths)
        x = dyadic(gen, (batch, seq, hidden), 1 / 8, 2.0)
        keep = torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]
        additive = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, torch.finfo(torch.float64).min)
        additive = additive[:, None, None, :]  # transformers' extended mask: the padded keys at the dtype's least
        expected = attention(x, attention_mask=additive, position_bias=encoder.compute_position_bias(x))[0]

        # the packed layout: the real rows back to back, q | k | v stacked, and the table by distance
        reach = seq + 6
        distances = torch.arange(1 - reach, reach)
        table = encoder.relative_attention_bias(mpnet.MPNetEncoder.relative_position_bucket(distances)).t()
        rows = x[keep]
        qkv = torch.cat([attention.q(rows), attention.k(rows), attention.v(rows)], dim=1)
    assert torch.equal(qkv.float().double(), qkv) and torch.equal(table.float().double(), table)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    out = _launch()(qkv.float().to(device), cu, seq, heads, table.float().contiguous().to(device))
    report = compare(out, expected[keep], torch.float32)
    assert report.ok, report
    # the same table with the distance's sign flipped (i - j) is a different attention: the convention is tested
    flipped = _launch()(qkv.float().to(device), cu, seq, heads, table.flip(1).float().contiguous().to(device))
    assert not compare(flipped, expected[keep], torch.float32).ok


# ---- the GPU: the model's shapes, graphs ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lengths,bound", [
    ([16], 16),                                        # a single short request
    ([128] * 32, 128),                                 # MPNet-base b32 s128 fixed
    ([7, 120, 33, 512, 1, 128, 90, 3, 0, 0], 512),     # mixed lengths up to the model's longest, filler sequences
])
def test_mpnet_base_shapes_on_the_gpu(dtype, lengths, bound):
    qkv, cu, bias = _inputs(lengths, 768, 12, dtype, "cuda", filler=13, reach=514, seed=len(lengths))
    out = torch.full((qkv.shape[0], 768), NAN, dtype=dtype, device="cuda")
    _launch()(qkv, cu, bound, 12, bias, out=out)
    _check(out, qkv, cu, bound, 12, bias, dtype)


@pytest.mark.gpu
def test_replays_in_a_cuda_graph_with_new_inputs():
    launch = _launch()
    qkv, cu, bias = _inputs([9, 30, 2], 768, 12, torch.float16, "cuda", filler=7, reach=514, seed=4)
    out = torch.empty((qkv.shape[0], 768), dtype=torch.float16, device="cuda")
    launch(qkv, cu, 64, 12, bias, out=out)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(qkv, cu, 64, 12, bias, out=out)
    qkv.copy_(_inputs([9, 30, 2], 768, 12, torch.float16, "cuda", filler=7, reach=514, seed=5)[0])
    cu.copy_(torch.tensor([0, 20, 41, 41], dtype=torch.int32))  # new lengths, same bound
    bias.copy_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(6)).cuda())
    out.fill_(NAN)
    graph.replay()
    torch.cuda.synchronize()
    _check(out, qkv, cu, 64, 12, bias, torch.float16)
