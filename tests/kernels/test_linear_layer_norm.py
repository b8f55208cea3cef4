"""LayerNorm(x @ W^T + bias + residual) through the Triton backend's launcher (cuBLAS GEMM + the add_layer_norm
kernel) against the float64 reference: odd M/K/N and every dtype into a poisoned `out`, strided and 3-D inputs, NaN
propagation, argument checks. On the GPU (`-m gpu`) or the interpreter."""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from fusedserve.kernels import reference
from fusedserve.kernels.testing import compare
from fusedserve.kernels.triton import linear_layer_norm as lln
from tests.conftest import DTYPES, shapes

DEPTHS = (7, 769)  # K: a short reduction, and a long one where the GEMM's rounding in fp16/bf16 shows


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


CASES = [(m, k, n, dtype) for (m, n), k, dtype in itertools.product(shapes(), DEPTHS, DTYPES)]


@pytest.mark.parametrize("m,k,n,dtype", CASES,
                         ids=lambda v: str(v).removeprefix("torch."))
def test_matches_float64_reference(device, m, k, n, dtype):
    args = _inputs(m, k, n, dtype, device, zlib.crc32(f"{m}-{k}-{n}-{dtype}".encode()))
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)  # every element must be written
    result = lln.linear_add_layer_norm(*args, 1e-5, out=out)
    assert result.data_ptr() == out.data_ptr()
    report = compare(result, _reference(*args), dtype)
    assert report.ok, report


def test_strided_and_3d_inputs(device):
    dtype = torch.float16
    x, weight, bias, residual, g, b = _inputs(10, 96, 160, dtype, device, seed=11)
    wide = torch.randn(10, 200, generator=torch.Generator().manual_seed(12)).to(device, dtype)
    strided = wide[:, 8:104]  # rows 200 apart
    assert not strided.is_contiguous()
    for inputs, res in ((strided, residual), (x.view(2, 5, 96), residual.view(2, 5, 160)),
                        (x.t().contiguous().t(), residual)):
        got = lln.linear_add_layer_norm(inputs, weight.t().contiguous().t(), bias, res, g, b, 1e-5)
        assert got.shape == (*inputs.shape[:-1], 160)
        want = _reference(inputs.reshape(-1, 96), weight, bias, res.reshape(-1, 160), g, b)
        report = compare(got.reshape(-1, 160), want, dtype)
        assert report.ok, report


def test_non_finite_inputs_stay_in_their_rows(device):
    x, weight, bias, residual, g, b = _inputs(33, 300, 70, torch.float32, device, seed=5)
    x[3, 7] = float("nan")
    residual[9, 0] = float("inf")
    got = lln.linear_add_layer_norm(x, weight, bias, residual, g, b, 1e-5)
    assert torch.isnan(got[3]).all() and torch.isnan(got[9]).all()
    finite = [r for r in range(33) if r not in (3, 9)]
    assert torch.isfinite(got[finite]).all()
    report = compare(got, _reference(x, weight, bias, residual, g, b), torch.float32)
    assert report.ok, report


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
