"""bench.encoder's FFN-in what-if (the Triton GEMM + bias + GELU epilogue in place of cuBLAS + bias_gelu), on the
Triton interpreter: the encoder's output is unchanged within the fp32 tolerance, the kernel really runs, and the
layer's own FFN-in is back afterwards."""

from __future__ import annotations

import pytest
import torch

from kernels.testing import compare
from model.config import EncoderConfig
from model.encoder import Encoder, Layer

pytest.importorskip("kernels.triton.linear_gelu")
if torch.cuda.is_available():
    pytest.skip("interpreter test (the GPU runs the what-if inside bench.encoder)", allow_module_level=True)


def test_ffn_in_epilogue_keeps_the_encoder_output(monkeypatch):
    from bench import encoder as bench_encoder
    from kernels.triton import linear_gelu

    encoder = Encoder(EncoderConfig.from_name("tiny")).eval()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1000, 5000, (3, 11), generator=gen)
    mask = torch.ones(3, 11, dtype=torch.bool)
    mask[1, 7:] = False
    with torch.inference_mode():
        expected = encoder(ids, mask).double()
        original = Layer._ffn_in
        calls = []
        real = linear_gelu.linear_bias_gelu
        monkeypatch.setattr(linear_gelu, "linear_bias_gelu", lambda *a, **k: calls.append(1) or real(*a, **k))
        with bench_encoder.ffn_in_epilogue():
            got = encoder(ids, mask)
        assert Layer._ffn_in is original
    assert len(calls) == encoder.config.num_layers
    report = compare(got, expected, torch.float32)
    assert report.ok, report
