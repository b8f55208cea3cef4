"""rms_norm and add_rms_norm beyond the generic float64 sweep (tests/kernels/test_triton_ops.py): the convention against
transformers' own Qwen3RMSNorm and Qwen2RMSNorm (the normalized value rounded to the input dtype before the weight),
the pre-norm sum add_rms_norm returns and normalizes (the residual stream added in the model dtype, as transformers'
decoder layers add it), rows of three exact column blocks and clear errors (its sm_90 compile: compile_check)."""

from __future__ import annotations

import pytest
import torch

from fusedserve.kernels import reference
from fusedserve.kernels.testing import OP_SPECS, compare, float64_reference
from fusedserve.kernels.triton import LAUNCHERS as triton_launchers
from tests.conftest import DTYPES, INTERPRETER

EPS = 1e-6  # Qwen2's and Qwen3's rms_norm_eps
HIDDEN = 384  # three exact column blocks of 128 (kernels/triton/_norm.py); the sweep's odd widths take a padded one


def _inputs(dtype, device, seed, rows=17):
    """x of order 3 with a non-zero mean (what RMSNorm scales by includes it) and a weight around 1."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, HIDDEN, generator=gen) * 3.0 + 0.5).to(device, dtype)
    residual = torch.randn(rows, HIDDEN, generator=gen).to(device, dtype)
    weight = (torch.randn(HIDDEN, generator=gen) * 0.5 + 1.0).to(device, dtype)
    return x, residual, weight


def _transformers_norms(dtype, weight):
    """transformers' Qwen3RMSNorm and Qwen2RMSNorm (the same code) in `dtype` with `weight`, on the CPU."""
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    qwen2 = pytest.importorskip("transformers.models.qwen2.modeling_qwen2")
    modules = [cls(HIDDEN, eps=EPS).to(dtype).eval() for cls in (qwen3.Qwen3RMSNorm, qwen2.Qwen2RMSNorm)]
    with torch.no_grad():
        for module in modules:
            module.weight.copy_(weight.cpu())
    return modules


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_matches_transformers_qwen_rms_norm(device, dtype):
    """The reference is transformers' Qwen3RMSNorm and Qwen2RMSNorm bit for bit in every dtype: h * rsqrt(mean(h^2) +
    eps) in fp32, rounded to the input dtype, then times the weight in that dtype. The kernel, into a NaN-poisoned
    out=, is within the dtype's tolerance of the module's output, and in fp16 equal to it in all but a few elements
    (its rsqrt and its order of summation may move a value across a rounding boundary); in fp16 the other order (the
    weight applied in fp32, one rounding) differs from transformers' in many elements, so this tells the two apart."""
    x, _, weight = _inputs(dtype, device, seed=1)
    xc, wc = x.cpu(), weight.cpu()
    with torch.no_grad():
        outputs = [module(xc) for module in _transformers_norms(dtype, weight)]
    expected = outputs[0]
    assert expected.dtype == dtype and torch.equal(outputs[1], expected)
    assert torch.equal(reference.rms_norm(xc, wc, EPS), expected)

    out = torch.full_like(x, float("nan"))
    assert triton_launchers["rms_norm"](x, weight, EPS, out=out) is out
    assert compare(out, expected, dtype).ok
    assert compare(out, float64_reference("rms_norm", (x, weight, EPS), {}), dtype).ok
    if dtype == torch.float16:
        assert (out.cpu() == expected).float().mean() > 0.99
        h = xc.float()
        one_rounding = (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + EPS) * wc.float()).to(dtype)
        assert (one_rounding != expected).float().mean() > 0.05


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_add_rms_norm_returns_the_sum_it_normalizes(device, dtype):
    """return_sum=True gives (y, s): s = x + residual in x's dtype (the residual stream a pre-norm decoder carries on)
    and y the RMSNorm of that rounded s, as transformers' Qwen3 decoder layer computes `hidden = residual + hidden`
    then its norm; the reference is that sequence bit for bit, and the kernel within the tolerance of the float64
    reference (in fp16 equal to the reference in all but a few elements, which the norm of the unrounded sum would not
    be). out= receives y; without return_sum y alone comes back."""
    x, residual, weight = _inputs(dtype, device, seed=2, rows=33)
    xc, rc, wc = x.cpu(), residual.cpu(), weight.cpu()
    ref_y, ref_s = reference.add_rms_norm(xc, rc, wc, EPS, return_sum=True)
    assert torch.equal(ref_s, xc + rc)
    with torch.no_grad():
        assert torch.equal(ref_y, _transformers_norms(dtype, weight)[0](xc + rc))

    out = torch.full_like(x, float("nan"))
    y, s = triton_launchers["add_rms_norm"](x, residual, weight, EPS, return_sum=True, out=out)
    assert y is out and s.shape == x.shape and s.dtype == dtype
    exact_y, exact_s = float64_reference("add_rms_norm", (x, residual, weight, EPS), {"return_sum": True})
    assert compare(s, exact_s, dtype).ok and compare(y, exact_y, dtype).ok
    if not INTERPRETER or dtype == torch.float16:  # the interpreter truncates fp32 to bf16; a GPU rounds
        assert torch.equal(s.cpu(), ref_s)
    if dtype == torch.float16:
        assert (y.cpu() == ref_y).float().mean() > 0.99
        unrounded = reference.rms_norm((xc.float() + rc.float()).double(), wc.double(), EPS).to(dtype)
        assert (unrounded != ref_y).float().mean() > 0.05
    alone = triton_launchers["add_rms_norm"](x, residual, weight, EPS)
    assert torch.is_tensor(alone) and torch.equal(alone, y)


def test_triton_only():
    """No CUDA kernel for the RMS ops: a CUDA backend forced globally leaves them on the reference."""
    assert dict(OP_SPECS["rms_norm"].fused_in) == {"triton": "rms_norm"}
    assert dict(OP_SPECS["add_rms_norm"].fused_in) == {"triton": "add_rms_norm"}


def test_clear_errors(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match=r"expected shape \(8,\)"):
        triton_launchers["rms_norm"](x, torch.ones(9, device=device))
    with pytest.raises(ValueError, match="residual shape"):
        triton_launchers["add_rms_norm"](x, x[:2], torch.ones(8, device=device))
    with pytest.raises(ValueError, match="out must be"):
        triton_launchers["rms_norm"](x, torch.ones(8, device=device), out=torch.empty(4, 8, device=device).t())
    assert triton_launchers["rms_norm"](x[:0], torch.ones(8, device=device)).shape == (0, 8)
