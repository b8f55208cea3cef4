"""LayerNorm(x @ W^T + bias + residual): the Triton split kernel (GEMM split over column tiles and K, LayerNorm in
the last program's epilogue) against the float64 reference on odd M/K/N and every dtype, its counters and
determinism, the many-rows path (cuBLAS + add_layer_norm), strided/3-D inputs, NaN propagation, argument checks,
and on the GPU its replay inside a CUDA graph. On the GPU (`-m gpu`) or the interpreter."""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from kernels import reference
from kernels.testing import compare
from tests.conftest import DEVICES, DTYPES, ODD_COLS, ROWS

lln = pytest.importorskip("kernels.triton.linear_layer_norm")

DEPTHS = (7, 769)  # K: below one BLOCK_K (one split), and deep enough to split with a ragged last step
SPLIT_EVERYTHING = 1 << 20  # small_rows: the split kernel at any row count


def _inputs(m: int, k: int, n: int, dtype: torch.dtype, device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    weight = torch.randn(n, k, generator=gen) / k**0.5
    bias = torch.randn(n, generator=gen) * 0.5 + 0.25
    residual = torch.randn(m, n, generator=gen) * 2
    ln_weight = torch.randn(n, generator=gen) * 0.5 + 1
    ln_bias = torch.randn(n, generator=gen) * 0.5
    return [t.to(device, dtype) for t in (x, weight, bias, residual, ln_weight, ln_bias)]


def _reference(x, weight, bias, residual, ln_weight, ln_bias):
    return reference.linear_add_layer_norm(*(t.detach().cpu().double() for t in (x, weight, bias, residual,
                                                                                 ln_weight, ln_bias)), 1e-5)


def _counters_zero(device: str) -> bool:
    """The counter buffer of `device`'s type exists and every counter is back at zero (the buffer is keyed by the
    tensors' device, cuda:0 for "cuda")."""
    buffers = [buf for d, buf in lln._counters.items() if d.type == torch.device(device).type]
    return len(buffers) == 1 and int(buffers[0].count_nonzero()) == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,k,n,dtype", list(itertools.product(ROWS, DEPTHS, ODD_COLS, DTYPES)),
                         ids=lambda v: str(v).removeprefix("torch."))
def test_split_kernel_matches_float64_reference(device, m, k, n, dtype):
    args = _inputs(m, k, n, dtype, device, zlib.crc32(f"{m}-{k}-{n}-{dtype}".encode()))
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)  # every element must be written
    result = lln.linear_add_layer_norm(*args, 1e-5, out=out, small_rows=SPLIT_EVERYTHING)
    assert result.data_ptr() == out.data_ptr()
    report = compare(result, _reference(*args), dtype)
    assert report.ok, report
    assert _counters_zero(device)  # every counter back at zero: ready for the next launch


@pytest.mark.parametrize("device", DEVICES)
def test_plan_splits_k_for_few_rows_and_never_leaves_a_split_empty(device):
    p = lln.plan(16, 384, 1536)  # MiniLM's FFN-out at one 16-token request
    assert p["SPLIT_K"] > 1 and (p["SPLIT_K"] - 1) * p["K_PER_SPLIT"] < 1536 <= p["SPLIT_K"] * p["K_PER_SPLIT"]
    assert lln.plan(16, 384, 7)["SPLIT_K"] == 1
    for m, n, k in itertools.product((1, 16, 37, 128), (1, 300, 768), (7, 64, 65, 384, 1536, 3072)):
        p = lln.plan(m, n, k)
        assert (p["SPLIT_K"] - 1) * p["K_PER_SPLIT"] < k <= p["SPLIT_K"] * p["K_PER_SPLIT"]
        assert p["K_PER_SPLIT"] % p["BLOCK_K"] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_repeated_launches_are_bitwise_identical(device):
    """Partials are summed in a fixed order (no fp32 atomics): the same input gives the same bits every time."""
    args = _inputs(16, 1536, 384, torch.float16, device, seed=3)
    first = lln.linear_add_layer_norm(*args, 1e-5, small_rows=16)
    assert lln.plan(16, 384, 1536)["SPLIT_K"] > 1
    for _ in range(3):
        assert torch.equal(lln.linear_add_layer_norm(*args, 1e-5, small_rows=16), first)
    assert _counters_zero(device)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_past_small_rows_take_cublas_and_add_layer_norm(device, monkeypatch):
    calls = []
    original = lln.launch_split
    monkeypatch.setattr(lln, "launch_split", lambda *a, **kw: calls.append(a[0].shape[0]) or original(*a, **kw))
    for m, limit in ((16, 16), (17, 16), (16, None)):  # None: the default, SMALL_ROWS
        args = _inputs(m, 40, 96, torch.float32, device, seed=m)
        report = compare(lln.linear_add_layer_norm(*args, 1e-5, small_rows=limit), _reference(*args), torch.float32)
        assert report.ok, (m, report)
    assert calls == [16] + ([16] if 16 <= lln.SMALL_ROWS else [])


@pytest.mark.parametrize("device", DEVICES)
def test_strided_and_3d_inputs(device):
    dtype = torch.float16
    x, weight, bias, residual, g, b = _inputs(10, 96, 160, dtype, device, seed=11)
    wide = torch.randn(10, 200, generator=torch.Generator().manual_seed(12)).to(device, dtype)
    strided = wide[:, 8:104]  # rows 200 apart
    assert not strided.is_contiguous()
    for inputs, res in ((strided, residual), (x.view(2, 5, 96), residual.view(2, 5, 160)),
                        (x.t().contiguous().t(), residual)):
        got = lln.linear_add_layer_norm(inputs, weight.t().contiguous().t(), bias, res, g, b, 1e-5,
                                        small_rows=SPLIT_EVERYTHING)
        assert got.shape == (*inputs.shape[:-1], 160)
        want = _reference(inputs.reshape(-1, 96), weight, bias, res.reshape(-1, 160), g, b)
        report = compare(got.reshape(-1, 160), want, dtype)
        assert report.ok, report


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_inputs_stay_in_their_rows(device):
    x, weight, bias, residual, g, b = _inputs(33, 300, 70, torch.float32, device, seed=5)
    x[3, 7] = float("nan")
    residual[9, 0] = float("inf")
    got = lln.linear_add_layer_norm(x, weight, bias, residual, g, b, 1e-5, small_rows=SPLIT_EVERYTHING)
    assert torch.isnan(got[3]).all() and torch.isnan(got[9]).all()
    finite = [r for r in range(33) if r not in (3, 9)]
    assert torch.isfinite(got[finite]).all()
    report = compare(got, _reference(x, weight, bias, residual, g, b), torch.float32)
    assert report.ok, report
    assert _counters_zero(device)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments_are_refused(device):
    x, weight, bias, residual, g, b = _inputs(4, 8, 16, torch.float32, device, seed=3)
    with pytest.raises(TypeError, match="share one of"):
        lln.linear_add_layer_norm(x.half(), weight, bias, residual, g, b)
    with pytest.raises(ValueError, match="do not fit"):
        lln.linear_add_layer_norm(x[:, :7], weight, bias, residual, g, b)
    with pytest.raises(ValueError, match="residual"):
        lln.linear_add_layer_norm(x, weight, bias, residual[:, :15], g, b)
    with pytest.raises(ValueError, match="ln_bias"):
        lln.linear_add_layer_norm(x, weight, bias, residual, g, b[:15])
    with pytest.raises(ValueError, match="out must be"):
        lln.linear_add_layer_norm(x, weight, bias, residual, g, b, out=torch.empty(4, 15, device=device))


@pytest.mark.gpu
def test_replays_inside_a_cuda_graph():
    """The counters reset themselves: a graph of several launches replays correctly again and again."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    shapes = ((16, 384, 384), (16, 1536, 384), (40, 3072, 768), (1, 769, 300))
    inputs = [_inputs(m, k, n, torch.float16, "cuda", seed=m + k + n) for m, k, n in shapes]
    for args in inputs:  # warm: compilation and the counter buffer outside the capture
        lln.linear_add_layer_norm(*args, 1e-5, small_rows=SPLIT_EVERYTHING)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [lln.linear_add_layer_norm(*args, 1e-5, small_rows=SPLIT_EVERYTHING) for args in inputs]
    for _ in range(3):
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for args, out in zip(inputs, outs):
            report = compare(out, _reference(*args), torch.float16)
            assert report.ok, report
    assert _counters_zero("cuda")
