"""bench.encoder's FFN-in what-if (the Triton GEMM + bias + GELU epilogue as every layer's FFN-in while the other
ops stay on the backend under test, through the registry's per-op override), on the Triton interpreter: the
encoder's output is unchanged within the fp32 tolerance, the kernel really runs once per layer, and the next
configure() without the override puts the FFN-in back."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.testing import compare
from model.config import EncoderConfig
from model.encoder import Encoder

triton_package = pytest.importorskip("kernels.triton")
if torch.cuda.is_available():
    pytest.skip("interpreter test (the GPU runs the what-if inside bench.encoder)", allow_module_level=True)


def test_ffn_in_override_keeps_the_encoder_output(monkeypatch):
    encoder = Encoder(EncoderConfig.from_name("tiny")).eval()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1000, 5000, (3, 11), generator=gen)
    mask = torch.ones(3, 11, dtype=torch.bool)
    mask[1, 7:] = False
    calls = []
    real = triton_package.LAUNCHERS["linear_bias_gelu"]
    monkeypatch.setitem(triton_package.LAUNCHERS, "linear_bias_gelu",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.inference_mode():
        expected = encoder(ids, mask).double()  # every op on the reference
        sel = kernels.configure("cpu", (torch.float32,), backend="torch", overrides={"linear_bias_gelu": "triton"},
                                hidden_sizes=(64,))
        assert sel.backend_of("linear_bias_gelu") == "triton" and sel.backend_of("add_layer_norm") == "torch"
        calls.clear()  # the self-test's calls
        got = encoder(ids, mask)
        assert len(calls) == encoder.config.num_layers
        back = kernels.configure("cpu", (torch.float32,), backend="torch", hidden_sizes=(64,))
        assert back.backend_of("linear_bias_gelu") == "torch"
        calls.clear()
        encoder(ids, mask)
        assert calls == []  # the FFN-in is back on the reference
    report = compare(got, expected, torch.float32)
    assert report.ok, report
