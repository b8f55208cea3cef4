"""The Triton GEMM with a gated-linear-unit epilogue (linear_glu) against the float64 reference: odd rows, widths and
depths in every dtype, GELU and SiLU, with and without a bias, into a poisoned output; non-finite inputs, strided and
3-D inputs, every candidate configuration, the TMA kernel, argument checks; and the op's convention against transformers' GteMLP
(GeGLU) and a SwiGLU written out. On the GPU (`-m gpu`) or the interpreter."""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch
from torch import nn

from fusedserve.kernels import reference
from fusedserve.kernels.testing import compare
from tests.kernels._shared import odd_layouts
from fusedserve.kernels.triton import linear_gelu, linear_glu

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ROWS = (1, 7, 300)
WIDTHS = (1, 7, 300, 769)  # I: one column, sub-warp, non-power-of-two, just past a power of two
DEPTH = 67  # K: odd, a ragged last step after one or two full ones (BLOCK_K 32 and 64)
# (activation, bias): each case of the sweep takes one, in turn, so that every dtype meets all four
VARIANTS = list(itertools.product(("gelu", "silu"), (True, False)))


def _ids(value) -> str:
    return str(value).removeprefix("torch.")


def _seed(*parts) -> int:
    return zlib.crc32("-".join(map(str, parts)).encode())


def _inputs(m: int, k: int, i: int, dtype: torch.dtype, device: str, seed: int, bias: bool = True):
    """x [m, k], weight [2i, k] and bias [2i] (or None) at the scales of spec._linear_glu_inputs: both halves of the
    product of order 1, where GELU and SiLU are not linear."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    weight = torch.randn(2 * i, k, generator=gen) / k**0.5
    b = torch.randn(2 * i, generator=gen) * 0.5
    return x.to(device, dtype), weight.to(device, dtype), b.to(device, dtype) if bias else None


def _reference(x, weight, bias, activation):
    double = lambda t: None if t is None else t.detach().cpu().double()  # noqa: E731
    return reference.linear_glu(double(x), double(weight), double(bias), activation)


SWEEP = [(m, i, dtype, *VARIANTS[(n + d) % len(VARIANTS)])
         for d, dtype in enumerate(DTYPES) for n, (m, i) in enumerate(itertools.product(ROWS, WIDTHS))]


@pytest.mark.parametrize("m,i,dtype,activation,bias", SWEEP, ids=_ids)
def test_matches_float64_reference(device, m, i, dtype, activation, bias):
    x, weight, b = _inputs(m, DEPTH, i, dtype, device, _seed(m, i, dtype, activation, bias), bias)
    out = torch.full((m, i), float("nan"), dtype=dtype, device=device)  # every element must be written
    result = linear_glu.linear_glu(x, weight, b, activation, out=out)
    assert result.data_ptr() == out.data_ptr()
    report = compare(result, _reference(x, weight, b, activation), dtype)
    assert report.ok, report


@pytest.mark.parametrize("dtype,activation", [(torch.float16, "gelu"), (torch.float32, "silu"),
                                              (torch.bfloat16, "silu")], ids=_ids)
def test_a_deep_reduction(device, dtype, activation):
    """K = 769: thirteen BLOCK_K steps, the last of one column (the rounding of long sums in half precision)."""
    x, weight, b = _inputs(33, 769, 300, dtype, device, _seed("deep", dtype, activation))
    report = compare(linear_glu.linear_glu(x, weight, b, activation), _reference(x, weight, b, activation), dtype)
    assert report.ok, report


# The TMA kernel (sm_90's GEMM-bound batches): rows past a 128-row tile, an I that a 128-column tile does not divide
# (the last tile's Wa rows run into Wb's, columns the store clips) and a ragged K. The interpreter's bf16 dot is wrong
# (test_matches_float64_reference runs its bf16 on fp32 products there), so bf16 runs on the GPU only.
TMA_CASES = [(300, 136, 96, torch.float16, "gelu", True), (130, 128, 64, torch.float16, "silu", False),
             (769, 328, 72, torch.bfloat16, "gelu", True), (513, 1152, 128, torch.bfloat16, "silu", False)]


@pytest.mark.parametrize("m,i,k,dtype,activation,bias", TMA_CASES, ids=_ids)
def test_the_tma_kernel_matches_float64_reference(device, m, i, k, dtype, activation, bias):
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("the interpreter's bf16 dot is wrong: bf16 on the GPU")
    x, weight, b = _inputs(m, k, i, dtype, device, _seed("tma", m, i, k, dtype), bias)
    out = torch.full((m, i), float("nan"), dtype=dtype, device=device)  # every element must be written
    linear_glu.launch_tma(x, weight, b, out, activation)
    report = compare(out, _reference(x, weight, b, activation), dtype)
    assert report.ok, report


@pytest.mark.gpu
def test_sm90_takes_the_tma_kernel_from_its_row_threshold():
    """Half precision at TMA_MIN_ROWS rows and more on an sm_90 GPU; fewer rows, fp32, or a row stride TMA cannot
    address take the autotuned kernel (and both give the reference's answer)."""
    capable = torch.cuda.get_device_capability() >= (9, 0)
    m = linear_glu.TMA_MIN_ROWS
    x, weight, _ = _inputs(m, 768, 256, torch.float16, "cuda", seed=11)
    y = torch.empty(m, 256, dtype=torch.float16, device="cuda")
    assert linear_glu._takes_tma(x, weight, y) == capable
    assert not linear_glu._takes_tma(x[:-1], weight, y[:-1])
    assert not linear_glu._takes_tma(x.float(), weight.float(), y.float())
    assert not linear_glu._takes_tma(x[:, 1:], weight[:, 1:], y)  # rows start 2 bytes off 16-byte alignment
    report = compare(linear_glu.linear_glu(x, weight, None), _reference(x, weight, None, "gelu"), torch.float16)
    assert report.ok, report


@pytest.mark.slow  # importing transformers takes most of its time
def test_gte_mlp_convention(device):
    """GTE's feed-forward in transformers: act_fn(gate_proj(x)) * up_proj(x) (exact GELU, no biases), the weights
    stacked as the model loads them (gate rows first), against GteMLP's own forward with its down projection left
    out, in float64."""
    GteConfig = getattr(pytest.importorskip("transformers"), "GteConfig", None)
    if GteConfig is None:
        pytest.skip("this transformers has no GTE (the H200 image's)")
    from transformers.models.gte.modeling_gte import GteMLP

    torch.manual_seed(3)
    hidden, inner = 40, 72
    mlp = GteMLP(GteConfig(hidden_size=hidden, intermediate_size=inner, hidden_act="gelu")).double().eval()
    mlp.down_proj = nn.Identity()
    x = torch.randn(19, hidden, dtype=torch.float64)
    with torch.no_grad():
        expected = mlp(x)
    weight = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
    for dtype in (torch.float32, torch.float16):
        got = linear_glu.linear_glu(x.to(device, dtype), weight.to(device, dtype), None, "gelu")
        # GteMLP on the inputs and weights rounded to dtype, as the kernel sees them, in float64
        report = compare(got, _gte(mlp, x, dtype), dtype)
        assert report.ok, (dtype, report)
    assert torch.equal(_gte(mlp, x, torch.float64), expected)  # _gte is GteMLP's forward


def _gte(mlp, x, dtype):
    """GteMLP's forward (down projection left out) on the inputs and weights rounded to `dtype`, in float64."""
    rounded = {name: p.detach().to(dtype).double() for name, p in mlp.named_parameters()}
    with torch.no_grad():
        return torch.func.functional_call(mlp, rounded, (x.to(dtype).double(),))


def test_swiglu_convention(device):
    """SwiGLU as NomicBERT and LLaMA write it: silu(a) * b with a = x Wa^T + ba the activated half (the weight's first
    rows) and silu(a) = a sigmoid(a), with biases, in float64 on the rounded inputs."""
    dtype = torch.float32
    x, weight, b = _inputs(29, 45, 50, dtype, device, seed=8)
    x64, w64, b64 = (t.cpu().double() for t in (x, weight, b))
    a = x64 @ w64[:50].T + b64[:50]
    up = x64 @ w64[50:].T + b64[50:]
    expected = a * torch.sigmoid(a) * up
    report = compare(linear_glu.linear_glu(x, weight, b, "silu"), expected, dtype)
    assert report.ok, report
    # the halves are not interchangeable: activating the other half is far outside the tolerance
    assert not compare(linear_glu.linear_glu(x, torch.cat([weight[50:], weight[:50]]),
                                             torch.cat([b[50:], b[:50]]), "silu"), expected, dtype).ok


def test_non_finite_inputs_propagate_like_the_reference(device):
    """A NaN in a row makes that row NaN, an infinite input gives the reference's NaN and infinities (-inf through
    either activation is NaN), and nothing else is touched; a NaN where the reference is finite never passes."""
    for activation in ("gelu", "silu"):
        x, weight, b = _inputs(33, 40, 70, torch.float32, device, seed=5)
        x[3, 7] = float("nan")
        x[9, 0] = float("inf")
        x[20, 5] = float("-inf")
        got = linear_glu.linear_glu(x, weight, b, activation)
        assert torch.isnan(got[3]).all() and torch.isfinite(got[21:]).all()
        assert not torch.isfinite(got[9]).all() and not torch.isfinite(got[20]).all()
        expected = _reference(x, weight, b, activation)
        report = compare(got, expected, torch.float32)
        assert report.ok, (activation, report)
        got[25, 3] = float("nan")
        assert not compare(got, expected, torch.float32).ok


def test_strided_and_3d_inputs(device):
    dtype = torch.float16
    x, weight, b = _inputs(2 * 5, 96, 80, dtype, device, seed=11)
    for inputs in odd_layouts(x):
        got = linear_glu.linear_glu(inputs, weight, b, "gelu")
        assert got.shape == (*inputs.shape[:-1], 80)
        report = compare(got, _reference(inputs, weight, b, "gelu"), dtype)
        assert report.ok, report
    column_strided = weight.t().contiguous().t()
    report = compare(linear_glu.linear_glu(x, column_strided, None, "silu"), _reference(x, weight, None, "silu"),
                     dtype)
    assert report.ok, report


def test_empty_and_one_column(device):
    x, weight, b = _inputs(0, 16, 8, torch.float32, device, seed=1)
    assert linear_glu.linear_glu(x, weight, b).shape == (0, 8)
    x, weight, b = _inputs(5, 1, 3, torch.float32, device, seed=2)  # K = 1
    assert compare(linear_glu.linear_glu(x, weight, b), _reference(x, weight, b, "gelu"), torch.float32).ok


def test_bad_arguments_are_refused(device):
    x, weight, b = _inputs(4, 8, 16, torch.float32, device, seed=3)
    with pytest.raises(ValueError, match="'relu'; supported: gelu, silu"):
        linear_glu.linear_glu(x, weight, b, "relu")
    with pytest.raises(TypeError, match="share one of"):
        linear_glu.linear_glu(x.half(), weight, b)
    with pytest.raises(TypeError, match="share one of"):
        linear_glu.linear_glu(x, weight, b.half())
    with pytest.raises(ValueError, match="do not fit"):
        linear_glu.linear_glu(x[:, :7], weight, b)
    with pytest.raises(ValueError, match="do not fit"):
        linear_glu.linear_glu(x, weight[:31], None)  # an odd number of weight rows has no two halves
    with pytest.raises(ValueError, match="do not fit"):
        linear_glu.linear_glu(x, weight, b[:16])
    with pytest.raises(ValueError, match="out must be"):
        linear_glu.linear_glu(x, weight, b, out=torch.empty(4, 32, device=device))


def test_activations_are_the_references():
    assert tuple(linear_glu.ACTIVATIONS) == reference.GLU_ACTIVATIONS
    with pytest.raises(ValueError, match="'relu'; supported: gelu, silu"):
        reference.linear_glu(torch.ones(2, 3), torch.ones(4, 3), None, "relu")


@pytest.mark.parametrize("dtype,bias", [(torch.float32, True), (torch.float16, False)], ids=_ids)
def test_every_candidate_config_computes_the_same_result(device, dtype, bias):
    """Each autotune candidate launched on its own (launch_config) matches the reference at a few-row shape with a
    ragged I and K, whichever of them the autotuner would pick."""
    m, k, i = 16, 100, 70
    x, weight, b = _inputs(m, k, i, dtype, device, seed=5, bias=bias)
    for activation in ("gelu", "silu"):
        expected = _reference(x, weight, b, activation)
        for config in linear_glu.CONFIGS:
            out = torch.full((m, i), float("nan"), dtype=dtype, device=device)
            linear_glu.launch_config(config, x, weight, b, out, activation)
            report = compare(out, expected, dtype)
            assert report.ok, (activation, config, report)


def test_configs_hold_linear_gelus_tiles_at_half_the_columns():
    """A candidate holds two weight tiles and two accumulators of BLOCK_N columns: linear_gelu's candidate at twice
    the columns, in the same order, with the same shared memory (so the same pruning on a GPU)."""
    assert len(linear_glu.CONFIGS) == len(linear_gelu.CONFIGS)
    for glu, gelu in zip(linear_glu.CONFIGS, linear_gelu.CONFIGS):
        assert {**glu.kwargs, "BLOCK_N": 2 * glu.kwargs["BLOCK_N"]} == gelu.kwargs
        assert (glu.num_warps, glu.num_stages) == (gelu.num_warps, gelu.num_stages)
        for size in (2, 4):
            assert linear_glu.shared_bytes(glu, size) == _gelu_shared_bytes(gelu, size)
    h200 = 232448  # shared_memory_per_block_optin on Hopper
    fp16 = linear_glu.configs_within(linear_glu.CONFIGS, 2, h200)
    fp32 = linear_glu.configs_within(linear_glu.CONFIGS, 4, h200)
    assert fp16 == linear_glu.CONFIGS  # every candidate fits in half precision, the 128 x 128 x 64 default first
    assert linear_glu.CONFIGS[0] not in fp32 and fp32  # but not in fp32, where a smaller one leads


def _gelu_shared_bytes(config, size: int) -> int:
    m, n, k = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"]
    return (m * k + k * n) * config.num_stages * size
