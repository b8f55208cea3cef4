"""The Triton GEMM + bias + GELU epilogue against the float64 reference: odd M/N/K, all dtypes, a poisoned
output, strided and 3-D inputs, NaN propagation, argument checks. On the GPU (`-m gpu`) or the interpreter."""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from fusedserve.kernels import reference
from fusedserve.kernels.testing import compare
from tests.kernels._shared import odd_layouts
from fusedserve.kernels.triton import linear_gelu
from tests.conftest import DTYPES, shapes

DEPTHS = (7, 769)  # K: below one BLOCK_K, and a ragged last K step


def _inputs(m: int, k: int, n: int, dtype: torch.dtype, device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    weight = torch.randn(n, k, generator=gen) / k**0.5  # outputs of order 1, where GELU is not linear
    bias = torch.randn(n, generator=gen) * 0.5
    return [t.to(device, dtype) for t in (x, weight, bias)]


def _reference(x, weight, bias, approximate="none"):
    return reference.linear_bias_gelu(*(t.detach().cpu().double() for t in (x, weight, bias)), approximate)


CASES = [(m, k, n, dtype) for (m, n), k, dtype in itertools.product(shapes(), DEPTHS, DTYPES)]


@pytest.mark.parametrize("m,k,n,dtype", CASES,
                         ids=lambda v: str(v).removeprefix("torch."))
def test_matches_float64_reference(device, m, k, n, dtype):
    x, weight, bias = _inputs(m, k, n, dtype, device, zlib.crc32(f"{m}-{k}-{n}-{dtype}".encode()))
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)  # every element must be written
    result = linear_gelu.linear_bias_gelu(x, weight, bias, out=out)
    assert result.data_ptr() == out.data_ptr()
    report = compare(result, _reference(x, weight, bias), dtype)
    assert report.ok, report


def test_tanh_mode_strided_and_3d_inputs(device):
    dtype = torch.float16
    x, weight, bias = _inputs(2 * 5, 96, 160, dtype, device, seed=11)
    for inputs in odd_layouts(x):
        got = linear_gelu.linear_bias_gelu(inputs, weight, bias)
        assert got.shape == (*inputs.shape[:-1], 160)
        report = compare(got, _reference(inputs, weight, bias), dtype)
        assert report.ok, report
    report = compare(linear_gelu.linear_bias_gelu(x, weight.t().contiguous().t(), bias, "tanh"),
                     _reference(x, weight, bias, "tanh"), dtype)
    assert report.ok, report


def test_non_finite_inputs_propagate_like_the_reference(device):
    x, weight, bias = _inputs(33, 40, 70, torch.float32, device, seed=5)
    x[3, 7] = float("nan")
    x[9, 0] = float("inf")
    got = linear_gelu.linear_bias_gelu(x, weight, bias)
    assert torch.isnan(got[3]).all() and torch.isfinite(got[10:]).all()
    report = compare(got, _reference(x, weight, bias), torch.float32)
    assert report.ok, report


def test_bad_arguments_are_refused(device):
    x, weight, bias = _inputs(4, 8, 16, torch.float32, device, seed=3)
    with pytest.raises(TypeError, match="share one of"):
        linear_gelu.linear_bias_gelu(x.half(), weight, bias)
    with pytest.raises(ValueError, match="do not fit"):
        linear_gelu.linear_bias_gelu(x[:, :7], weight, bias)
    with pytest.raises(ValueError, match="do not fit"):
        linear_gelu.linear_bias_gelu(x, weight, bias[:15])
    with pytest.raises(ValueError, match="out must be"):
        linear_gelu.linear_bias_gelu(x, weight, bias, out=torch.empty(4, 15, device=device))
    with pytest.raises(ValueError, match="approximate"):
        linear_gelu.linear_bias_gelu(x, weight, bias, "sigmoid")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=lambda v: str(v).removeprefix("torch."))
def test_every_candidate_config_computes_the_same_result(device, dtype):
    """Each autotune candidate launched on its own (launch_config) matches the
    reference at a few-row shape with a ragged N and K, whichever of them the autotuner would pick."""
    m, k, n = 16, 100, 200
    x, weight, bias = _inputs(m, k, n, dtype, device, 5)
    expected = _reference(x, weight, bias)
    for config in linear_gelu.CONFIGS:
        out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
        linear_gelu.launch_config(config, x, weight, bias, out)
        report = compare(out, expected, dtype)
        assert report.ok, (config, report)


def test_configs_that_overflow_shared_memory_are_pruned():
    h200 = 232448  # shared_memory_per_block_optin on Hopper
    fp16 = linear_gelu.configs_within(linear_gelu.CONFIGS, 2, h200)
    fp32 = linear_gelu.configs_within(linear_gelu.CONFIGS, 4, h200)
    assert fp16[0] is linear_gelu.CONFIGS[0]  # the 128x256x64 default fits in half precision
    assert linear_gelu.CONFIGS[0] not in fp32 and fp32  # but not in fp32, where a smaller one leads
    assert len(linear_gelu.configs_within(linear_gelu.CONFIGS, 4, 48 * 1024)) < len(fp32)

