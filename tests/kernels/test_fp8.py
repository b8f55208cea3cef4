"""The FP8 ops (kernels/fp8.py, Triton kernels in kernels/triton/fp8.py): each row quantized to E4M3 with its own
scale, checked against the float64 value it quantizes (within the rounding bound) and against the torch reference
(the same E4M3 values); the GEMM on quantized operands against float64. Runs on the GPU (`-m gpu`) or the Triton
interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fusedserve.kernels import fp8
from fusedserve.kernels.triton import fp8 as triton_fp8

COLS = (1, 7, 300, 769, 1023, 4097)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _inputs(rows: int, cols: int, dtype, device, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0, shift=0.0):
        return (torch.randn(shape, generator=gen) * scale + shift).to(device, dtype)

    return (randn(rows, cols, scale=2.0, shift=0.5), randn(rows, cols), randn(cols, scale=0.5),
            randn(cols, scale=0.5, shift=1.0), randn(cols, scale=0.5))


def _steps(q: torch.Tensor) -> torch.Tensor:
    """E4M3 codes as signed steps from zero: the magnitude bits, negated where the sign bit is set."""
    code = q.view(torch.uint8).int().cpu()
    magnitude = code & 0x7F
    return torch.where(code >= 0x80, -magnitude, magnitude)


def assert_codes_agree(q: torch.Tensor, reference: torch.Tensor) -> None:
    """The E4M3 codes equal the reference's but for a value whose fp32 quotient (or GELU) sits within an ulp of a
    rounding tie, which may land on the other side (the GPU's division and the kernel's GELU are not the CPU's): such
    a code is the neighbouring one, and at most one in a thousand (at least one allowed) is. Codes are compared as
    steps on the number line (sign and magnitude -> a signed integer), so -0 equals +0: the GPU's GELU of a large
    negative input is -0, the CPU's +0."""
    a, b = _steps(q), _steps(reference)
    differ = a != b
    assert int(differ.sum()) <= max(1, a.numel() // 1000), f"{int(differ.sum())} of {a.numel()} codes differ"
    assert ((a - b).abs()[differ] == 1).all(), "a code differs by more than one E4M3 step"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cols", COLS)
def test_quantizing_ops_match_float64(device, cols, dtype):
    rows = 5 if cols > 1000 else 33
    x, residual, bias, weight, ln_bias = _inputs(rows, cols, dtype, device, seed=cols)
    q, s = triton_fp8.quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and s.shape == (rows, 1) and s.dtype == torch.float32
    assert fp8.quantization_error(q, s, x) <= 1.01
    assert_codes_agree(q, fp8.quantize_rows_reference(x)[0])

    q, s = triton_fp8.bias_gelu_quantize(x, bias)
    assert fp8.quantization_error(q, s, F.gelu(x.double() + bias.double())) <= 1.01
    assert_codes_agree(q, fp8.bias_gelu_quantize_reference(x, bias)[0])

    y, q, s = triton_fp8.add_layer_norm_quantize(x, residual, bias, weight, ln_bias, 1e-12)
    want = F.layer_norm(x.double() + residual.double() + bias.double(), (cols,), weight.double(), ln_bias.double(),
                        1e-12)
    atol = {torch.float16: 8e-3, torch.bfloat16: 6e-2, torch.float32: 1e-4}[dtype]
    assert y.dtype == dtype and (y.double() - want).abs().max() <= atol
    assert fp8.quantization_error(q, s, y) <= 1.01
    assert_codes_agree(q, fp8.quantize_rows_reference(y)[0])  # its own output's codes (y may differ by an ulp)


def test_rounding_is_to_nearest_even_and_saturates(device):
    # values at and between E4M3 steps, ties included, where the interpreter's own cast goes wrong (kernel docstring)
    steps = torch.tensor([1.0, 1.0625, 1.1875, 126.5, 124.0, 127.9, 440.0, 447.9, 3.3, 0.3, 2.0 ** -9, 2.0 ** -10 * 3])
    row = torch.cat([steps, -steps, torch.tensor([448.0])])[None].to(device)  # amax 448: a scale of exactly 1
    q, s = triton_fp8.quantize_rows(row)
    assert float(s) == 1.0
    assert torch.equal(q.float().cpu(), row.cpu().to(torch.float8_e4m3fn).float())


def test_zero_rows_and_non_finite_inputs(device):
    x = torch.zeros(3, 64, device=device)
    x[1, 5] = float("nan")
    x[2, 0] = float("inf")
    q, s = triton_fp8.quantize_rows(x)
    assert torch.equal(q[0].float().cpu(), torch.zeros(64)) and 0 < float(s[0]) < 1e-14
    assert not torch.isfinite(s[1:]).all(dim=1).any()  # a NaN or Inf row never passes as a finite answer


def test_empty_batch(device):
    q, s = triton_fp8.quantize_rows(torch.empty(0, 384, device=device, dtype=torch.float16))
    assert q.shape == (0, 384) and s.shape == (0, 1)


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_linear_matches_float64_within_fp8_rounding(rows):
    # torch._scaled_mm on the CPU (torch 2.14); the GPU tests run it on the tensor cores
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 384, generator=gen)
    w = torch.randn(1536, 384, generator=gen) / 384 ** 0.5
    b = torch.randn(1536, generator=gen) * 0.1
    weight = fp8.quantize_weight(w)
    assert weight.values.dtype == torch.float8_e4m3fn and weight.scale.shape == (1, 1536)
    out = fp8.linear(*fp8.quantize_rows_reference(x), weight, b, torch.float32)
    want = x.double() @ w.double().t() + b.double()
    rel = float((out.double() - want).norm() / want.norm())
    assert 0 < rel < 0.06  # E4M3 keeps 3 mantissa bits: ~4% on random data (bench kernels gemm-fp8)


def test_weights_of_unaligned_shapes_are_refused():
    with pytest.raises(fp8.Fp8Unavailable, match=r"\[100, 384\].*multiples of 16"):
        fp8.quantize_weight(torch.randn(100, 384))


def test_refused_off_fp8_gpus():
    assert "no FP8 tensor cores" in fp8.unavailable(torch.device("cpu"))


def test_self_test_catches_a_broken_kernel(monkeypatch):
    fp8.self_test(torch.device("cpu"), torch.float32, (384,))  # the references pass their own test
    monkeypatch.setattr(fp8, "bias_gelu_quantize", lambda x, b: fp8.quantize_rows_reference(x))  # GELU forgotten
    with pytest.raises(fp8.Fp8Unavailable, match="bias_gelu_quantize failed its self-test at 384 columns"):
        fp8.self_test(torch.device("cpu"), torch.float32, (384,))
