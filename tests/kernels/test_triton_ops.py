"""Every Triton op against the float64 reference: odd shapes, all dtypes, poisoned outputs, strided and
3-D inputs, NaN/Inf propagation; the torch.library registration (opcheck, autograd, torch.compile).
Runs on the device this machine has: the GPU (`-m gpu` selects these there too) or the Triton interpreter."""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from fusedserve import kernels
from fusedserve.kernels import library, reference
from fusedserve.kernels.testing import OP_SPECS, ops_of, ROWWISE_OPS, check_op, compare, float64_reference
from fusedserve.kernels.spec import attention_heads, launcher_modules, rotary_heads
from fusedserve.kernels.triton import LAUNCHERS as triton_launchers
from fusedserve.kernels.triton.qkv_attention import MAX_HEAD_DIM
from fusedserve.kernels.triton.disentangled_attention import MAX_HEAD_DIM as DISENTANGLED_MAX_HEAD_DIM
from fusedserve.kernels.triton.relative_attention import MAX_HEAD_DIM as RELATIVE_MAX_HEAD_DIM
from fusedserve.kernels.triton.rotary_attention import MAX_HEAD_DIM as ROTARY_MAX_HEAD_DIM
from tests.kernels._shared import FORMULAS, check_offsets_past_two_to_the_31, opcheck_custom_ops
from tests.conftest import DTYPES, INTERPRETER, shapes

# The generic sweep: every op x shapes() x DTYPES, less the cases another test already runs here:
# - the GEMM ops: tests/kernels/test_linear_gelu.py and test_linear_layer_norm.py sweep the same rows x cols x dtypes
#   through the same launchers, at two reduction depths each; test_linear_glu.py sweeps odd rows x widths x dtypes
#   through its launcher, both activations, with and without a bias; test_splade_pool.py sweeps odd hidden and vocab
#   widths x dtypes with sequences of every kind, with and without a bias;
# - on the interpreter, bf16 of the ops whose bf16 path it cannot run (its bf16 dot is wrong and its fp32 -> bf16
#   conversion truncates): they take the fp32 path there, which the float32 case covers (the GPU runs their bf16);
# - on the interpreter, the attention ops at widths whose heads (spec.attention_heads, spec.rotary_heads) are too wide
#   for the kernel: the launcher hands those to the torch reference, which tests/kernels/test_reference.py checks at
#   the same rows, cols and dtype (the hand-off itself: the heads-too-wide tests of test_qkv_attention.py,
#   test_relative_attention.py and test_rotary_attention.py);
# - on the interpreter, most many-row cases of the RMS ops at the wide widths (300 columns and up): their kernel is the
#   LayerNorm kernel's body (kernels/triton/_norm.py) with other statistics, whose row tiles and column masks the
#   LayerNorm ops' cases cover, and each such case costs the interpreter a second or two. They run every width and
#   dtype on one row and on the narrow many-row shapes, and one wide many-row shape each (RMS_MANY_ROWS);
#   tests/kernels/test_rms_norm.py adds many rows of three exact blocks in every dtype. The GPU runs them all.
SWEPT_ELSEWHERE = ("linear_bias_gelu", "linear_add_layer_norm", "linear_glu", "splade_pool")
FP32_ON_THE_INTERPRETER = ("qkv_attention", "attention_partials", "ffn_partials", "relative_attention",
                           "rotary_attention", "disentangled_attention")
# the widest head each attention kernel takes (wider: the torch path)
MAX_HEAD_DIMS = {"qkv_attention": MAX_HEAD_DIM, "attention_partials": MAX_HEAD_DIM,
                 "relative_attention": RELATIVE_MAX_HEAD_DIM, "rotary_attention": ROTARY_MAX_HEAD_DIM,
                 "disentangled_attention": DISENTANGLED_MAX_HEAD_DIM}


def _head_dim(op: str, cols: int) -> int:
    """The head width of an attention op's sweep inputs at `cols` (kernels.spec: rotary_attention rounds an odd width
    up and takes heads of an even width)."""
    if op == "rotary_attention":
        width = cols + cols % 2
        return width // rotary_heads(width)
    return cols // attention_heads(cols)


RMS_MANY_ROWS = {("rms_norm", 769): torch.bfloat16, ("add_rms_norm", 4097): torch.float16}


def _swept(op: str, rows: int, cols: int, dtype: torch.dtype) -> bool:
    if op in SWEPT_ELSEWHERE:
        return False
    if INTERPRETER and op in ("rms_norm", "add_rms_norm") and rows > 1 and cols >= 300:
        return RMS_MANY_ROWS.get((op, cols)) == dtype
    if INTERPRETER and op in FP32_ON_THE_INTERPRETER and dtype == torch.bfloat16:
        return False
    if INTERPRETER and op in MAX_HEAD_DIMS:
        return _head_dim(op, cols) <= MAX_HEAD_DIMS[op]
    return True


SWEEP = [(op, rows, cols, dtype) for op, (rows, cols), dtype in itertools.product(ops_of("triton"), shapes(), DTYPES)
         if _swept(op, rows, cols, dtype)]


def _seed(*parts) -> int:
    return zlib.crc32("-".join(map(str, parts)).encode())


@pytest.mark.parametrize("op,rows,cols,dtype", SWEEP, ids=lambda v: str(v).removeprefix("torch."))
def test_matches_float64_reference(device, op, rows, cols, dtype):
    report = check_op(triton_launchers[op], op, rows, cols, dtype, device, seed=_seed(op, rows, cols, dtype))
    assert report.ok, report


# the row-wise ops taking a [rows, cols] x: ROWWISE_OPS, and the RMS ops (outside it: kernels/spec.py says why)
ROW_INPUT_OPS = [*(op for op in ROWWISE_OPS if op != "embedding_layer_norm"), "rms_norm", "add_rms_norm"]


@pytest.mark.parametrize("op", ROW_INPUT_OPS)
def test_strided_and_3d_inputs(device, op):
    gen = torch.Generator().manual_seed(_seed("strided", op))
    args, kwargs = OP_SPECS[op].make_inputs(2 * 5, 96, torch.float16, device, gen)
    # row-strided view (a slice of a wider buffer), column-strided view (a transpose), and 3-D
    wide = torch.randn(10, 160, generator=gen).to(device, torch.float16)
    wide[:, :96] = args[0]
    col_strided = args[0].t().contiguous().t()
    for x in (wide[:, :96], col_strided, args[0].view(2, 5, 96)):
        call = (x, *(a.view(2, 5, 96) if x.dim() == 3 and torch.is_tensor(a) and a.dim() == 2 else a for a in args[1:]))
        out = triton_launchers[op](*call, **kwargs)
        assert out.shape == x.shape
        assert compare(out, float64_reference(op, call, kwargs), torch.float16).ok


@pytest.mark.parametrize("op", ROW_INPUT_OPS)
def test_nan_and_inf_propagate_like_reference(device, op):
    gen = torch.Generator().manual_seed(_seed("nan", op))
    args, kwargs = OP_SPECS[op].make_inputs(9, 300, torch.float32, device, gen)
    x = args[0].clone()
    x[2, 17], x[5, 0], x[7, 299] = float("nan"), float("inf"), float("-inf")
    args = (x, *args[1:])
    out = triton_launchers[op](*args, **kwargs)
    ref = float64_reference(op, args, kwargs)
    assert torch.isnan(out).any()  # the test really has non-finite values in it
    assert compare(out, ref, torch.float32).ok


@pytest.mark.parametrize("cols", [769, 384])  # a padded block; three exact blocks
def test_add_layer_norm_sum_and_no_bias(device, cols):
    gen = torch.Generator().manual_seed(11)
    (x, residual, bias, w, b, eps), _ = OP_SPECS["add_layer_norm"].make_inputs(33, cols, torch.bfloat16, device, gen)
    y, s = triton_launchers["add_layer_norm"](x, residual, bias, w, b, eps, return_sum=True)
    y_ref, s_ref = reference.add_layer_norm(*(t.double() for t in (x, residual, bias, w, b)), eps, return_sum=True)
    assert compare(y, y_ref, torch.bfloat16).ok and compare(s, s_ref, torch.bfloat16).ok
    no_bias = triton_launchers["add_layer_norm"](x, residual, None, w, b, eps)
    assert compare(no_bias, reference.add_layer_norm(x.double(), residual.double(), None, w.double(), b.double(), eps),
                   torch.bfloat16).ok


@pytest.mark.parametrize("op,cols", list(itertools.product(["layer_norm_gelu", "bias_gelu", "bias_residual_gelu"],
                                                          [300, 384])))
def test_tanh_gelu_option(device, op, cols):
    gen = torch.Generator().manual_seed(_seed("tanh", op, cols))
    args, _ = OP_SPECS[op].make_inputs(17, cols, torch.float32, device, gen)
    out = triton_launchers[op](*args, approximate="tanh")
    assert compare(out, float64_reference(op, args, {"approximate": "tanh"}), torch.float32).ok
    exact = triton_launchers[op](*args)
    assert not torch.equal(out, exact)


def test_each_launcher_is_the_function_the_spec_places_it_in():
    """kernels.triton.LAUNCHERS is derived from kernels.spec: every Triton op, the function named after it defined
    in the module the spec names (not one imported there from another launcher's module)."""
    modules = launcher_modules("triton")
    assert list(triton_launchers) == list(modules) == ops_of("triton")
    for op, module in modules.items():
        assert triton_launchers[op].__name__ == op
        assert triton_launchers[op].__module__ == f"fusedserve.kernels.triton.{module}"


def test_clear_errors(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match=r"expected shape \(8,\)"):
        triton_launchers["layer_norm"](x, torch.ones(9, device=device), torch.zeros(8, device=device))
    with pytest.raises(ValueError, match="residual shape"):
        triton_launchers["add_layer_norm"](x, x[:2], None, torch.ones(8, device=device), torch.zeros(8, device=device))
    with pytest.raises(ValueError, match="approximate"):
        triton_launchers["bias_gelu"](x, torch.ones(8, device=device), "fast")
    with pytest.raises(ValueError, match="unsupported dtype"):
        triton_launchers["bias_gelu"](x.to(torch.int32), torch.ones(8, device=device, dtype=torch.int32))
    with pytest.raises(ValueError, match="exceed"):
        triton_launchers["bias_gelu"](torch.randn(1, 20000, device=device), torch.ones(20000, device=device))


def test_empty_input(device):
    x = torch.randn(0, 64, device=device)
    assert triton_launchers["layer_norm"](x, torch.ones(64, device=device), torch.zeros(64, device=device)).shape == (0, 64)


# ---- torch.library registration --------------------------------------------------------------------

@pytest.fixture
def triton_ops():
    return library.custom_ops("triton", triton_launchers)


def test_opcheck_custom_ops(device, triton_ops):
    opcheck_custom_ops("triton", device)


def test_gradcheck_float64(device, triton_ops):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 11, generator=gen, dtype=torch.float64).to(device).requires_grad_()
    r = torch.randn(3, 11, generator=gen, dtype=torch.float64).to(device).requires_grad_()
    vecs = [(torch.randn(11, generator=gen, dtype=torch.float64) * 0.5 + 1).to(device).requires_grad_() for _ in range(3)]
    w, b, bias = vecs
    assert torch.autograd.gradcheck(lambda x, w, b: triton_ops["layer_norm_gelu"](x, w, b, 1e-5), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, r, bias, w, b: triton_ops["add_layer_norm"](x, r, bias, w, b, 1e-5),
                                    (x, r, bias, w, b))
    # gradients through the pre-norm sum too
    assert torch.autograd.gradcheck(
        lambda x, r, w, b: torch.cat(triton_ops["add_layer_norm"](x, r, None, w, b, 1e-5, return_sum=True)),
        (x, r, w, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_match_float64_autograd_of_the_formula(device, dtype, triton_ops):
    """The differentiable fused ops' gradients (torch.library autograd, recomputed through the reference) against
    float64 autograd of the ops' formulas written out independently (tests/kernels/_shared.py), on the same rounded
    inputs and output gradient, within the dtype's tolerance."""
    gen = torch.Generator().manual_seed(7)
    (x, residual, bias, w, b, eps), _ = OP_SPECS["add_layer_norm"].make_inputs(8, 300, dtype, device, gen)
    grad_out = torch.randn(8, 300, generator=gen).to(device, dtype)

    def grads(fn, inputs, upstream):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        fn(*leaves, eps).backward(upstream)
        return [t.grad for t in leaves]

    for op, inputs in (("add_layer_norm", (x, residual, bias, w, b)), ("layer_norm_gelu", (x, w, b))):
        ours = grads(triton_ops[op], inputs, grad_out)
        exact = grads(FORMULAS[op], [t.detach().to("cpu", torch.float64) for t in inputs], grad_out.cpu().double())
        for i, (got, want) in enumerate(zip(ours, exact)):
            assert got.dtype == dtype
            report = compare(got, want, dtype)
            assert report.ok, f"{op}: gradient of input {i}: {report}"


def test_torch_compile_fullgraph_on_fused_encoder(device):
    from fusedserve.model.config import EncoderConfig
    from fusedserve.model.bert import Encoder

    selection = kernels.select(device, (torch.float32,), backend="triton", hidden_sizes=(64,))
    encoder = Encoder(EncoderConfig.from_name("tiny").replace(num_layers=1)).to(device).eval()
    ids = torch.randint(1000, 2000, (3, 9), device=device)
    mask = torch.ones(3, 9, dtype=torch.bool, device=device)
    mask[1, 5:] = False
    with torch.no_grad(), kernels.use(selection):
        eager = encoder(ids, mask)
        # fullgraph=True fails on any graph break; aot_eager keeps CPU CI fast, inductor runs on the GPU
        compiled = torch.compile(encoder, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
        torch.testing.assert_close(compiled(ids, mask), eager, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["bias_gelu", "add_layer_norm"])
def test_offsets_past_two_to_the_31(op):
    check_offsets_past_two_to_the_31(triton_launchers, op)


def test_norm_candidates_include_one_row_programs():
    """The LayerNorm autotuner's candidates: the heuristic default (the first) is two rows of 768 on one warp, and
    one-row programs are among them (a b1 batch's 16 rows spread over 16 programs; the fastest candidate in some
    fp32 cells). Every candidate holds at most 16384 elements on 1-16 warps."""
    from fusedserve.kernels.triton import _norm

    configs = _norm.norm_configs(768, 256)
    assert configs[0] == (2, 1)
    assert {m for m, _ in configs} == {1, 2, 4, 16}
    assert {m for m, _ in _norm.norm_configs(1024, 1024)} == {1, 2, 4, 16}
    for row, chunk in ((768, 256), (384, 128), (1024, 1024), (4096, 4096)):
        for block_m, warps in _norm.norm_configs(row, chunk):
            assert block_m * row <= 16384 and 1 <= warps <= 16


def test_pointwise_candidates_hold_whole_vectors_per_thread():
    """The elementwise GELU autotuner's candidates: 4 elements a thread (one 16-byte fp32 vector) only for fp32 and
    fp64; for fp16 and bf16 a thread holds at least 8 (one 16-byte vector), so the half-width candidates are not
    compiled and timed for nothing. The pruning reads the dtype from the launch's input."""
    from fusedserve.kernels.triton import _pointwise

    for block_n in (128, 256, 1024):
        half = _pointwise.pointwise_configs(block_n, 2)
        single = _pointwise.pointwise_configs(block_n, 4)
        assert half[0] == single[0] and set(half) < set(single)
        assert all(block_m * block_n >= 32 * warps * 8 for block_m, warps in half)
        assert any(block_m * block_n == 32 * warps * 4 for block_m, warps in single)
    configs = _pointwise._CONFIGS
    kept = {dtype: _pointwise._prune(configs, {"X": torch.empty(1, dtype=dtype)}, BLOCK_N=256)
            for dtype in (torch.float16, torch.float32)}
    assert len(kept[torch.float16]) < len(kept[torch.float32])
    assert [(c.kwargs["BLOCK_M"], c.num_warps) for c in kept[torch.float16]] == _pointwise.pointwise_configs(256, 2)


def test_column_blocks():
    """Rows of 3 x 2^k are held as three exact blocks (no padding lanes), other widths as one padded block; the
    elementwise GELU kernels take the largest power of two dividing the width, else a padded block."""
    from fusedserve.kernels.triton._norm import column_chunks
    from fusedserve.kernels.triton._pointwise import column_block

    assert [column_chunks(n) for n in (384, 768, 1536, 48, 1024, 4096, 300, 769, 24)] == [
        (3, 128), (3, 256), (3, 512), (3, 16), (1, 1024), (1, 4096), (1, 512), (1, 1024), (1, 32)]
    assert [column_block(n) for n in (384, 768, 1536, 4096, 300, 4097, 96)] == [128, 256, 512, 1024, 512, 1024, 128]


EXACT_BLOCK_OPS = ("layer_norm", "layer_norm_gelu", "add_layer_norm", "embedding_layer_norm", "bias_gelu",
                   "bias_residual_gelu")


@pytest.mark.parametrize("op,cols,dtype", list(itertools.product(EXACT_BLOCK_OPS, (48, 384), (torch.float32,
                                                                                               torch.bfloat16))),
                         ids=lambda v: str(v).removeprefix("torch."))
def test_exact_column_blocks_match_float64_reference(device, op, cols, dtype):
    """The generic sweep's odd widths all take the padded path; the encoders' widths take the exact blocks."""
    for rows in (1, 33):
        report = check_op(triton_launchers[op], op, rows, cols, dtype, device, seed=_seed("exact", op, rows, cols))
        assert report.ok, (rows, report)


def test_programmatic_dependent_launch_only_where_the_device_has_it(device):
    """FUSEDSERVE_TRITON_PDL asks for PDL; a launcher adds it only on a CUDA device of sm_90 or later (never under
    the interpreter), and the few-token ops and relative_attention give the same results with the setting on (the GPU
    test checks every bit with it actually in use, tests/gpu/test_graphs_gpu.py)."""
    from fusedserve.kernels.triton._common import INTERPRET, pdl_args, pdl_launches

    x = torch.randn(16, 32, device=device)
    before = pdl_args(x)
    with pdl_launches(False):
        assert pdl_args(x) == {"USE_PDL": False}
    with pdl_launches(True):
        expected = (not INTERPRET and x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9)
        assert pdl_args(x) == ({"USE_PDL": True, "launch_pdl": True} if expected else {"USE_PDL": False})
        assert pdl_args(x.cpu()) == {"USE_PDL": False}
        for op in ("partial_add_layer_norm", "ffn_partials", "attention_partials", "segment_mean",
                   "relative_attention", "rotary_attention"):
            report = check_op(triton_launchers[op], op, 7, 64, torch.float32, x.device, seed=_seed("pdl", op))
            assert report.ok, (op, report)
    assert pdl_args(x) == before  # the setting from before the test is back
