"""The torch reference ops against the ops' formulas written out again in float64 (tests/kernels/_shared.py), at every
dtype and as the float64 oracle the backends are checked against; and the checker itself (it must be able to fail)."""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from fusedserve.kernels import reference
from fusedserve.kernels.spec import REFERENCE_OPS
from fusedserve.kernels.testing import OP_SPECS, compare, check_op, float64_reference
from tests.conftest import DTYPES, ODD_COLS, ROWS
from tests.kernels._shared import formula_float64

CASES = list(itertools.product(OP_SPECS, ROWS, ODD_COLS, DTYPES))


@pytest.mark.parametrize("op,rows,cols,dtype", CASES, ids=lambda v: str(v).removeprefix("torch."))
def test_reference_matches_the_ops_formula(op, rows, cols, dtype):
    """The reference at `dtype`, into a poisoned out=, within the dtype's tolerance of the op's formula in float64;
    and at float32's inputs the oracle (the reference evaluated in float64) within float64's: a formula the reference
    gets wrong fails here, though every backend checked against it would pass."""
    seed = zlib.crc32(f"{op}-{rows}-{cols}-{dtype}".encode())
    report = check_op(REFERENCE_OPS[op], op, rows, cols, dtype, "cpu", seed=seed, oracle=formula_float64)
    assert report.ok, report
    if dtype == torch.float32 and cols <= 1023:  # once per shape, the widest left out to keep the sweep quick
        args, kwargs = OP_SPECS[op].make_inputs(rows, cols, dtype, "cpu", torch.Generator().manual_seed(seed))
        report = compare(float64_reference(op, args, kwargs), formula_float64(op, args, kwargs), torch.float64)
        assert report.ok, f"the float64 oracle: {report}"


def test_the_formula_check_fails_a_wrong_reference():
    """The check above can fail: a LayerNorm with eps outside the square root (a difference far below the float32
    tolerance) is caught by the float64 comparison, and a 1% gain error at every dtype."""
    def eps_outside(x, w, b, eps=1e-12, *, out=None):
        h = x.double()
        mean = h.mean(-1, keepdim=True)
        y = (h - mean) / ((h - mean).pow(2).mean(-1, keepdim=True).sqrt() + eps) * w.double() + b.double()
        return out.copy_(y) if out is not None else y

    args, kwargs = OP_SPECS["layer_norm"].make_inputs(37, 300, torch.float32, "cpu", torch.Generator().manual_seed(1))
    expected = formula_float64("layer_norm", args, kwargs)
    assert compare(eps_outside(*args), expected, torch.float32).ok  # what the float32 tolerance alone lets through
    assert not compare(eps_outside(*args), expected, torch.float64).ok
    for dtype in DTYPES:
        report = check_op(lambda x, w, b, eps, *, out: reference.layer_norm(x, w * 1.01, b, eps, out=out),
                          "layer_norm", 37, 300, dtype, "cpu", seed=2, oracle=formula_float64)
        assert not report.ok, dtype


@pytest.mark.parametrize("op", OP_SPECS)
def test_reference_without_out_returns_the_specified_output(op):
    gen = torch.Generator().manual_seed(1)
    args, kwargs = OP_SPECS[op].make_inputs(5, 33, torch.bfloat16, "cpu", gen)
    result = REFERENCE_OPS[op](*args, **kwargs)
    shape, dtype = OP_SPECS[op].output(args, 5, 33, torch.bfloat16)
    assert result.dtype == dtype and result.shape == shape
    # fp32 out of bf16 in: the pooled means, SPLADE maxima and BGE-M3 sparse weights, and a split GEMM's partial sums
    assert dtype == (torch.float32 if op in ("segment_mean", "splade_pool", "m3_sparse", "attention_partials",
                                             "ffn_partials") else torch.bfloat16)
    assert compare(result, float64_reference(op, args, kwargs), torch.bfloat16).ok


def test_add_layer_norm_returns_pre_norm_sum_and_accepts_no_bias():
    gen = torch.Generator().manual_seed(2)
    x, residual, bias, w, b = (torch.randn(4, 17, generator=gen) for _ in range(5))
    w, b, bias = w[0], b[0], bias[0]
    y, s = reference.add_layer_norm(x, residual, bias, w, b, 1e-5, return_sum=True)
    torch.testing.assert_close(s, x + residual + bias)
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(s, (17,), w, b, 1e-5))
    no_bias = reference.add_layer_norm(x, residual, None, w, b, 1e-5)
    torch.testing.assert_close(no_bias, torch.nn.functional.layer_norm(x + residual, (17,), w, b, 1e-5))


def test_gelu_is_exact_erf_and_tanh_is_optional():
    x = torch.linspace(-6, 6, 1001, dtype=torch.float64)[None]
    zero = torch.zeros(1001, dtype=torch.float64)
    torch.testing.assert_close(reference.bias_gelu(x, zero), torch.nn.functional.gelu(x), rtol=0, atol=1e-15)
    torch.testing.assert_close(reference.bias_gelu(x, zero, "tanh"), torch.nn.functional.gelu(x, approximate="tanh"))
    with pytest.raises(ValueError, match="approximate"):
        reference.bias_gelu(x, zero, "sigmoid")


@pytest.mark.parametrize("op", ["layer_norm", "bias_gelu", "add_layer_norm"])
def test_nan_and_inf_propagate_like_float64(op):
    gen = torch.Generator().manual_seed(3)
    args, kwargs = OP_SPECS[op].make_inputs(6, 40, torch.float32, "cpu", gen)
    x = args[0].clone()
    x[1, 3], x[4, 0] = float("nan"), float("inf")
    args = (x, *args[1:])
    assert compare(REFERENCE_OPS[op](*args, **kwargs), float64_reference(op, args, kwargs), torch.float32).ok


class TestCompare:
    ref = torch.randn(64, 64, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def test_accepts_rounding(self):
        assert compare(self.ref.to(torch.bfloat16), self.ref, torch.bfloat16).ok
        assert compare(self.ref.to(torch.float16), self.ref, torch.float16).ok
        assert compare(self.ref.to(torch.float32), self.ref, torch.float32).ok

    def test_nan_never_passes(self):
        out = self.ref.clone()
        out[7, 7] = float("nan")
        report = compare(out, self.ref, torch.float32)
        assert not report.ok and "finiteness" in report.reason

    def test_unwritten_poisoned_output_fails(self):
        out = torch.full_like(self.ref, float("nan"))
        out[:32] = self.ref[:32]
        assert not compare(out, self.ref, torch.bfloat16).ok

    def test_one_wrong_element_fails(self):
        out = self.ref.clone()
        out[3, 5] += 0.05
        report = compare(out, self.ref, torch.float16)
        assert not report.ok and "beyond atol" in report.reason

    def test_systematic_error_fails(self):
        assert not compare(self.ref * 1.02, self.ref, torch.bfloat16).ok

    def test_shape_mismatch_fails(self):
        assert not compare(self.ref[:5], self.ref, torch.float32).ok

    def test_check_op_rejects_ignoring_out(self):
        report = check_op(lambda *a, out=None, **k: reference.layer_norm(*a, **k), "layer_norm", 3, 8,
                          torch.float32, "cpu", seed=0)
        assert not report.ok and "out=" in report.reason
