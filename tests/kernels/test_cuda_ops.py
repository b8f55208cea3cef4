"""Every CUDA op against the float64 reference (odd shapes, all dtypes, poisoned outputs), misaligned views
that must take the scalar path, every launch configuration the tuner may pick, the tuner and its cache,
clear errors, NaN/Inf, int64 offsets, and the torch.library registration. GPU only (-m gpu); the CUDA sources
are compile-checked without a GPU by test_cuda_compile.py and the build by test_cuda_build.py."""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from fusedserve.kernels import library, reference
from fusedserve.kernels.testing import OP_SPECS, ops_of, ROWWISE_OPS, check_op, compare, float64_reference
from tests.kernels._shared import cache_directory, check_offsets_past_two_to_the_31, opcheck_custom_ops
from tests.conftest import DTYPES, ODD_COLS, ROWS

pytestmark = pytest.mark.gpu


def _seed(*parts) -> int:
    return zlib.crc32("-".join(map(str, parts)).encode())


@pytest.fixture(scope="module")
def launchers():
    from fusedserve.kernels import cuda

    return cuda.load()  # a build failure on a GPU machine fails the tests: it must not hide as a skip


@pytest.mark.parametrize("op,rows,cols,dtype", list(itertools.product(ops_of("cuda"), ROWS, ODD_COLS, DTYPES)),
                         ids=lambda v: str(v).removeprefix("torch."))
def test_matches_float64_reference(launchers, op, rows, cols, dtype):
    report = check_op(launchers[op], op, rows, cols, dtype, "cuda", seed=_seed("cuda", op, rows, cols, dtype))
    assert report.ok, report


@pytest.mark.parametrize("op", [op for op in ROWWISE_OPS if op != "embedding_layer_norm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_misaligned_and_strided_views(launchers, op, dtype):
    """Slices of a wider buffer: the row start is off 16-byte alignment (scalar path) or the row stride is
    not a multiple of the vector width; results must still match."""
    gen = torch.Generator().manual_seed(_seed("misaligned", op, dtype))
    args, kwargs = OP_SPECS[op].make_inputs(37, 768, dtype, "cuda", gen)
    for offset, width in ((1, 770), (0, 771), (8, 784)):
        views = []
        for a in args:
            if torch.is_tensor(a) and a.dim() == 2:
                buf = torch.randn(37, width, generator=gen).to("cuda", dtype)
                buf[:, offset:offset + 768] = a
                views.append(buf[:, offset:offset + 768])
            else:
                views.append(a)
        out = launchers[op](*views, **kwargs)
        assert compare(out, float64_reference(op, tuple(views), kwargs), dtype).ok, (offset, width)


@pytest.mark.parametrize("cols", [64, 384, 768, 1024, 4096, 4097, 16384])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_norm_launch_config(launchers, cols, dtype):
    from fusedserve.kernels.cuda.tuning import norm_candidates

    gen = torch.Generator().manual_seed(_seed("configs", cols, dtype))
    (x, residual, bias, w, b, eps), _ = OP_SPECS["add_layer_norm"].make_inputs(67, cols, dtype, "cuda", gen)
    ref = float64_reference("add_layer_norm", (x, residual, bias, w, b, eps), {})
    for config in norm_candidates(cols):
        y = torch.full_like(x, float("nan"))
        torch.ops.fusedserve_cuda.norm(x, residual, bias, w, b, eps, 0, y, None, *config)
        assert compare(y, ref, dtype).ok, config


@pytest.mark.parametrize("cols", [8, 768, 3072, 4097])
def test_every_pointwise_launch_config(launchers, cols):
    from fusedserve.kernels.cuda.tuning import POINTWISE_CONFIGS

    gen = torch.Generator().manual_seed(_seed("pw-configs", cols))
    (x, bias, residual), _ = OP_SPECS["bias_residual_gelu"].make_inputs(300, cols, torch.bfloat16, "cuda", gen)
    ref = float64_reference("bias_residual_gelu", (x, bias, residual), {})
    for config in POINTWISE_CONFIGS:
        y = torch.full_like(x, float("nan"))
        torch.ops.fusedserve_cuda.bias_act(x, bias, residual, 1, y, *config)
        assert compare(y, ref, torch.bfloat16).ok, config


def test_unsupported_config_is_a_clear_error(launchers):
    x = torch.randn(4, 4096, device="cuda")
    w, b, y = torch.ones(4096, device="cuda"), torch.zeros(4096, device="cuda"), torch.empty(4, 4096, device="cuda")
    with pytest.raises(RuntimeError, match="unsupported launch configuration"):
        torch.ops.fusedserve_cuda.norm(x, None, None, w, b, 1e-5, 0, y, None, 32, 256)  # 32 threads x 32 < 4096
    with pytest.raises(RuntimeError, match="must be a CUDA tensor"):
        torch.ops.fusedserve_cuda.norm(x, None, None, w.cpu(), b, 1e-5, 0, y, None, 128, 256)


@pytest.fixture
def cache_dir(tmp_path):
    with cache_directory(tmp_path):
        yield tmp_path


def test_tuner_sweeps_once_per_shape_class_and_caches_to_disk(launchers, cache_dir, monkeypatch):
    from fusedserve.kernels.cuda import tuning

    monkeypatch.setattr(tuning, "TUNER", tuning.Tuner())
    monkeypatch.setattr("fusedserve.kernels.cuda.launchers.TUNER", tuning.TUNER)
    gen = torch.Generator().manual_seed(3)
    args, _ = OP_SPECS["layer_norm_gelu"].make_inputs(4096, 768, torch.bfloat16, "cuda", gen)
    out = launchers["layer_norm_gelu"](*args)
    table = tuning.TUNER.table()
    assert list(table) == ["norm|bfloat16|768|13"]
    entry = table["norm|bfloat16|768|13"]
    assert tuple(entry["config"]) in tuning.norm_candidates(768) and 0 < entry["us"] <= entry["heuristic_us"]
    assert entry["candidates"] == len(tuning.norm_candidates(768))  # every candidate ran
    assert compare(out, float64_reference("layer_norm_gelu", args, {}), torch.bfloat16).ok
    launchers["layer_norm_gelu"](*OP_SPECS["layer_norm_gelu"].make_inputs(5000, 768, torch.bfloat16, "cuda", gen)[0])
    assert len(tuning.TUNER.table()) == 1  # same bucket: no new sweep
    launchers["layer_norm_gelu"](*OP_SPECS["layer_norm_gelu"].make_inputs(7, 768, torch.bfloat16, "cuda", gen)[0])
    assert len(tuning.TUNER.table()) == 1  # below TUNE_MIN_ROWS: heuristic, nothing recorded
    files = list(cache_dir.glob("tuning-*.json"))
    assert len(files) == 1 and "norm|bfloat16|768|13" in files[0].read_text()
    fresh = tuning.Tuner()  # a later process on the same GPU model starts tuned
    assert fresh.choose("norm", torch.bfloat16, 768, 4096, [(999, 999), (998, 998)],
                        lambda c: None) == tuple(entry["config"])


@pytest.mark.parametrize("op", [op for op in ROWWISE_OPS if op != "embedding_layer_norm"])
def test_nan_and_inf_propagate_like_reference(launchers, op):
    gen = torch.Generator().manual_seed(_seed("cuda-nan", op))
    args, kwargs = OP_SPECS[op].make_inputs(9, 300, torch.float32, "cuda", gen)
    x = args[0].clone()
    x[2, 17], x[5, 0], x[7, 299] = float("nan"), float("inf"), float("-inf")
    args = (x, *args[1:])
    out = launchers[op](*args, **kwargs)
    assert torch.isnan(out).any()
    assert compare(out, float64_reference(op, args, kwargs), torch.float32).ok


def test_add_layer_norm_sum_no_bias_tanh_and_3d(launchers):
    gen = torch.Generator().manual_seed(11)
    (x, residual, bias, w, b, eps), _ = OP_SPECS["add_layer_norm"].make_inputs(33, 768, torch.bfloat16, "cuda", gen)
    y, s = launchers["add_layer_norm"](x, residual, bias, w, b, eps, return_sum=True)
    y_ref, s_ref = reference.add_layer_norm(*(t.double().cpu() for t in (x, residual, bias, w, b)), eps,
                                            return_sum=True)
    assert compare(y, y_ref, torch.bfloat16).ok and compare(s, s_ref, torch.bfloat16).ok
    no_bias = launchers["add_layer_norm"](x, residual, None, w, b, eps)
    assert compare(no_bias, float64_reference("add_layer_norm", (x, residual, None, w, b, eps), {}), torch.bfloat16).ok
    x3 = x.view(3, 11, 768)
    assert launchers["layer_norm"](x3, w, b, eps).shape == (3, 11, 768)
    for op in ("layer_norm_gelu", "bias_gelu", "bias_residual_gelu"):
        args, _ = OP_SPECS[op].make_inputs(17, 300, torch.float32, "cuda", gen)
        tanh = launchers[op](*args, approximate="tanh")
        assert compare(tanh, float64_reference(op, args, {"approximate": "tanh"}), torch.float32).ok
        assert not torch.equal(tanh, launchers[op](*args))


def test_clear_errors(launchers):
    x = torch.randn(4, 8, device="cuda")
    with pytest.raises(ValueError, match="one CUDA device"):
        launchers["layer_norm"](x.cpu(), torch.ones(8), torch.zeros(8))
    with pytest.raises(ValueError, match="unsupported dtype"):
        launchers["bias_gelu"](x.double(), torch.ones(8, device="cuda", dtype=torch.float64))
    with pytest.raises(ValueError, match=r"expected shape \(8,\)"):
        launchers["layer_norm"](x, torch.ones(9, device="cuda"), torch.zeros(8, device="cuda"))
    with pytest.raises(ValueError, match="residual shape"):
        launchers["add_layer_norm"](x, x[:2], None, torch.ones(8, device="cuda"), torch.zeros(8, device="cuda"))
    with pytest.raises(ValueError, match="approximate"):
        launchers["bias_gelu"](x, torch.ones(8, device="cuda"), "fast")
    with pytest.raises(ValueError, match="exceed"):
        launchers["layer_norm"](torch.randn(1, 20000, device="cuda"), torch.ones(20000, device="cuda"),
                                torch.zeros(20000, device="cuda"))
    assert launchers["layer_norm"](torch.randn(0, 64, device="cuda"), torch.ones(64, device="cuda"),
                                   torch.zeros(64, device="cuda")).shape == (0, 64)


@pytest.mark.parametrize("op", ["bias_gelu", "add_layer_norm"])
def test_offsets_past_two_to_the_31(launchers, op):
    check_offsets_past_two_to_the_31(launchers, op)


def test_opcheck_and_compile(launchers):
    from fusedserve import kernels
    from fusedserve.model.config import EncoderConfig
    from fusedserve.model.bert import Encoder

    library.custom_ops("cuda", launchers)
    opcheck_custom_ops("cuda", "cuda")
    selection = kernels.select("cuda", (torch.float32,), backend="cuda", hidden_sizes=(64,))
    encoder = Encoder(EncoderConfig.from_name("tiny").replace(num_layers=1)).cuda().eval()
    ids = torch.randint(1000, 2000, (3, 9), device="cuda")
    mask = torch.ones(3, 9, dtype=torch.bool, device="cuda")
    mask[1, 5:] = False
    with torch.no_grad(), kernels.use(selection):
        eager = encoder(ids, mask)
        compiled = torch.compile(encoder, fullgraph=True)
        torch.testing.assert_close(compiled(ids, mask), eager, rtol=1e-4, atol=1e-4)


def test_auto_mode_races_triton_and_cuda_on_the_gpu(launchers):
    from fusedserve import kernels

    for timing in ("eager", "device"):  # the ops both backends implement (the CUDA one lacks the attention ops)
        selection = kernels.select("cuda", (torch.float16,), hidden_sizes=(384,), race_timing=timing,
                                   ops=list(launchers))
        assert sum(c.used for c in selection.choices.values()) == len(launchers) >= 9
        for choice in (c for c in selection.choices.values() if c.used):
            assert choice.backend in ("triton", "cuda"), selection.report()
            assert set(choice.timings_us) == {"triton", "cuda"}, selection.report()
            assert choice.backend == min(choice.timings_us, key=choice.timings_us.get)
            assert f"{timing} timing" in choice.reason  # device timing did not fall back
        print("\n" + selection.report())
