"""The CPU backend's GEMM blocks (kernels/cpu/aten.py) against the float64 reference: odd M/K/N in every dtype into
a poisoned `out`, strided and 3-D inputs, NaN and infinity kept to their rows, and the registry choosing them on the
CPU. Runs on any machine (CPU tensors)."""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from fusedserve import kernels
from fusedserve.kernels import reference
from fusedserve.kernels.cpu import aten
from fusedserve.kernels.testing import compare
from tests.conftest import DTYPES, ODD_COLS, ROWS
from tests.kernels import test_linear_gelu as gelu_case
from tests.kernels import test_linear_layer_norm as ln_case
from tests.kernels._shared import odd_layouts

CASES = list(itertools.product(ROWS, (7, 769), ODD_COLS, DTYPES))  # M, K, N, dtype: the full sweep (no interpreter)


def _seed(*values) -> int:
    return zlib.crc32("-".join(map(str, values)).encode())


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("m,k,n,dtype", CASES, ids=lambda v: str(v).removeprefix("torch."))
def test_linear_bias_gelu_matches_float64_reference(m, k, n, dtype, approximate):
    x, weight, bias = gelu_case._inputs(m, k, n, dtype, "cpu", _seed(m, k, n, dtype))
    out = torch.full((m, n), float("nan"), dtype=dtype)  # every element must be written
    result = aten.linear_bias_gelu(x, weight, bias, approximate, out=out)
    assert result.data_ptr() == out.data_ptr()
    report = compare(result, gelu_case._reference(x, weight, bias, approximate), dtype)
    assert report.ok, report


@pytest.mark.parametrize("m,k,n,dtype", CASES, ids=lambda v: str(v).removeprefix("torch."))
def test_linear_add_layer_norm_matches_float64_reference(m, k, n, dtype):
    args = ln_case._inputs(m, k, n, dtype, "cpu", _seed(m, k, n, dtype))
    out = torch.full((m, n), float("nan"), dtype=dtype)
    result = aten.linear_add_layer_norm(*args, 1e-5, out=out)
    assert result.data_ptr() == out.data_ptr()
    report = compare(result, ln_case._reference(*args), dtype)
    assert report.ok, report


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_and_3d_inputs(dtype):
    x, weight, bias = gelu_case._inputs(10, 96, 160, dtype, "cpu", seed=11)
    _, _, _, residual, g, b = ln_case._inputs(10, 96, 160, dtype, "cpu", seed=12)
    for inputs in odd_layouts(x):
        flat = inputs.reshape(-1, 96)
        got = aten.linear_bias_gelu(inputs, weight.t().contiguous().t(), bias)
        assert got.shape == (*inputs.shape[:-1], 160)
        assert compare(got.reshape(-1, 160), gelu_case._reference(flat, weight, bias), dtype).ok
        res = residual.view(*inputs.shape[:-1], 160)
        got = aten.linear_add_layer_norm(inputs, weight, bias, res, g, b, 1e-5)
        assert got.shape == (*inputs.shape[:-1], 160)
        assert compare(got.reshape(-1, 160), ln_case._reference(flat, weight, bias, residual, g, b), dtype).ok


def test_non_finite_inputs_stay_in_their_rows():
    x, weight, bias, residual, g, b = ln_case._inputs(33, 300, 70, torch.float32, "cpu", seed=5)
    x[3, 7] = float("nan")
    residual[9, 0] = float("inf")
    got = aten.linear_add_layer_norm(x, weight, bias, residual, g, b, 1e-5)
    assert torch.isnan(got[3]).all() and torch.isnan(got[9]).all()
    assert torch.isfinite(got[[r for r in range(33) if r not in (3, 9)]]).all()
    x, weight, bias = gelu_case._inputs(33, 300, 70, torch.float32, "cpu", seed=6)
    x[5, 0] = float("nan")
    got = aten.linear_bias_gelu(x, weight, bias)
    assert torch.isnan(got[5]).all()
    assert torch.isfinite(got[[r for r in range(33) if r != 5]]).all()


def test_a_gelu_input_of_infinity_is_nan_after_the_layers_next_layer_norm_either_way():
    # ATen's CPU GELU answers NaN for +-inf where the reference answers +inf / -0 (the module's docstring): what the
    # encoder serves is the LayerNorm after the FFN-out GEMM, where such a row is NaN on both paths
    x, w1, b1 = gelu_case._inputs(4, 16, 64, torch.float32, "cpu", seed=7)
    x[1] = float("inf")
    _, w2, b2, residual, g, b = ln_case._inputs(4, 64, 16, torch.float32, "cpu", seed=8)
    ours = aten.linear_add_layer_norm(aten.linear_bias_gelu(x, w1, b1), w2, b2, residual, g, b, 1e-5)
    theirs = reference.linear_add_layer_norm(reference.linear_bias_gelu(x, w1, b1), w2, b2, residual, g, b, 1e-5)
    assert torch.isnan(ours[1]).all() and torch.isnan(theirs[1]).all()
    torch.testing.assert_close(ours[[0, 2, 3]], theirs[[0, 2, 3]])


def test_the_registry_runs_them_on_the_cpu_and_not_elsewhere(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a CPU server's registry: no interpreted Triton
    ops = ("linear_bias_gelu", "linear_add_layer_norm", "embedding_layer_norm")
    sel = kernels.select("cpu", (torch.float32, torch.bfloat16), ops=ops)
    assert sel.backend_of("linear_bias_gelu") == sel.backend_of("linear_add_layer_norm") == "cpu"
    assert sel.backend_of("embedding_layer_norm") == "torch"  # not one of its ops: stays on the reference
    with pytest.raises(ValueError, match="CPU tensors"):
        aten.linear_bias_gelu(torch.ones(2, 2, device="meta"), torch.ones(2, 2, device="meta"),
                              torch.ones(2, device="meta"))
