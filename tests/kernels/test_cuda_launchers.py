"""The CUDA backend's Python launchers without a GPU: argument shaping (3-D inputs, out=, return_sum, int32 ids,
the tuner hand-off) checked by standing in for torch.ops.fusedserve_cuda with the torch reference math. The
kernels themselves are tested on the GPU (test_cuda_ops.py); this keeps the launcher layer covered in CI."""

from __future__ import annotations

import pytest
import torch

from fusedserve.kernels import reference
from fusedserve.kernels.spec import launcher_modules
from fusedserve.kernels.testing import OP_SPECS, ops_of, compare, float64_reference


class ReferenceOps:
    """The four torch.ops.fusedserve_cuda schemas, computed with the reference; checks what the C++ side
    requires of its arguments (2-D, unit column stride, int64 contiguous ids, valid configs)."""

    def __init__(self):
        self.configs = []

    def norm(self, x, residual, bias, w, ln_bias, eps, gelu, y, pre_norm_sum, tpr, block):
        assert x.dim() == 2 and x.stride(1) == 1 and y.is_contiguous()
        self.configs.append(("norm", tpr, block))
        h = x.float() + (residual.float() if residual is not None else 0) + (bias.float() if bias is not None else 0)
        if pre_norm_sum is not None:
            pre_norm_sum.copy_(h)
        out = torch.nn.functional.layer_norm(h, h.shape[-1:], w.float(), ln_bias.float(), eps)
        y.copy_(reference._gelu(out, {1: "none", 2: "tanh"}[gelu]) if gelu else out)

    def embedding_norm(self, ids, pos, types, word, position, token_type, w, b, eps, y, tpr, block):
        assert all(t.dtype == torch.int64 and t.is_contiguous() and t.dim() == 1 for t in (ids, pos, types))
        self.configs.append(("embedding_norm", tpr, block))
        y.copy_(reference.embedding_layer_norm(ids, pos, types, word, position, token_type, w, b, eps))

    def bias_act(self, x, bias, residual, gelu, y, threads, rows_per_thread):
        assert x.dim() == 2 and x.stride(1) == 1 and y.is_contiguous()
        self.configs.append(("bias_act", threads, rows_per_thread))
        h = x.float() + bias.float() + (residual.float() if residual is not None else 0)
        y.copy_(reference._gelu(h, {1: "none", 2: "tanh"}[gelu]))

    def segment_mean(self, x, cu_seqlens, y):
        assert x.dim() == 2 and x.stride(1) == 1 and cu_seqlens.is_contiguous() and y.dtype == torch.float32
        self.configs.append(("segment_mean",))
        y.copy_(reference.segment_mean(x, cu_seqlens))


@pytest.fixture
def launchers(monkeypatch):
    from fusedserve.kernels.cuda import launchers as module

    fake = ReferenceOps()
    monkeypatch.setattr(module, "_ops", fake)
    monkeypatch.setattr(module, "_check", lambda *tensors: None)  # the real one demands CUDA tensors
    # kernels.cuda.load()'s table without the build: kernels.spec places every CUDA launcher in this module
    modules = launcher_modules("cuda")
    assert set(modules.values()) == {"launchers"} and list(modules) == ops_of("cuda")
    return {op: getattr(module, op) for op in modules}, fake


def test_load_returns_the_launchers_the_spec_places(monkeypatch):
    """kernels.cuda.load() (the build stood in for): {op: launcher} for exactly the ops kernels.spec lists as CUDA's,
    each the function named after its op in the module the spec names."""
    from fusedserve.kernels import cuda
    from fusedserve.kernels.cuda import build

    monkeypatch.setattr(build, "load", lambda verbose=False: None)
    table = cuda.load()
    assert list(table) == ops_of("cuda")
    for op, module in launcher_modules("cuda").items():
        assert table[op].__name__ == op and table[op].__module__ == f"fusedserve.kernels.cuda.{module}"


@pytest.mark.parametrize("op", ops_of("cuda"))
def test_launchers_shape_arguments_and_write_into_out(launchers, op):
    table, fake = launchers
    gen = torch.Generator().manual_seed(3)
    args, kwargs = OP_SPECS[op].make_inputs(37, 300, torch.float32, "cpu", gen)
    shape, dtype = OP_SPECS[op].output(args, 37, 300, torch.float32)
    out = torch.full(shape, float("nan"), dtype=dtype)
    result = table[op](*args, **kwargs, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert compare(result, float64_reference(op, args, kwargs), torch.float32).ok
    from fusedserve.kernels.cuda.tuning import norm_candidates, pointwise_candidates

    kind, *config = fake.configs[-1]
    if kind == "segment_mean":
        return  # one launch configuration, no tuner
    expected = pointwise_candidates(300, 37)[0] if kind == "bias_act" else norm_candidates(300)[0]
    assert tuple(config) == expected  # 37 rows: below the tuning threshold, the heuristic config


def test_3d_views_sum_and_int32_ids(launchers):
    table, _ = launchers
    gen = torch.Generator().manual_seed(4)
    (x, residual, bias, w, b, eps), _ = OP_SPECS["add_layer_norm"].make_inputs(12, 64, torch.float32, "cpu", gen)
    y, s = table["add_layer_norm"](x.view(3, 4, 64), residual.view(3, 4, 64), bias, w, b, eps, return_sum=True)
    assert y.shape == s.shape == (3, 4, 64)
    assert compare(s.view(12, 64), (x + residual + bias).double(), torch.float32).ok
    strided = torch.randn(12, 80, generator=gen)[:, :64]  # row stride 80: passed through without a copy
    assert compare(table["layer_norm"](strided, w, b, eps), float64_reference("layer_norm", (strided, w, b, eps), {}),
                   torch.float32).ok
    args, _ = OP_SPECS["embedding_layer_norm"].make_inputs(15, 64, torch.float32, "cpu", gen)
    ids = args[0].view(3, 5).to(torch.int32)
    y = table["embedding_layer_norm"](ids, args[1].view(3, 5), args[2].view(3, 5), *args[3:])
    assert y.shape == (3, 5, 64)
    with pytest.raises(ValueError, match="id tensors differ in shape"):
        table["embedding_layer_norm"](ids, args[1], args[2], *args[3:])
    with pytest.raises(ValueError, match="approximate"):
        table["bias_gelu"](x, bias, "fast")


def test_pointwise_heuristic_walks_one_row_per_thread_below_the_tuning_threshold(launchers):
    from fusedserve.kernels.cuda.tuning import POINTWISE_CONFIGS, TUNE_MIN_ROWS, pointwise_candidates

    small, large = pointwise_candidates(1536, 16), pointwise_candidates(1536, TUNE_MIN_ROWS)
    assert small[0] == (256, 1) and large[0] == (256, 4) == pointwise_candidates(1536)[0]
    assert sorted(small) == sorted(large) == sorted(POINTWISE_CONFIGS)  # the same sweep, another first pick
    table, fake = launchers
    gen = torch.Generator().manual_seed(5)
    (x, bias), _ = OP_SPECS["bias_gelu"].make_inputs(16, 1536, torch.float32, "cpu", gen)
    table["bias_gelu"](x, bias)
    assert fake.configs[-1] == ("bias_act", 256, 1)
