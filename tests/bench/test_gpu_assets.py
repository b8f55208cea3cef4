"""bench.gpu_assets: the fp16 copy the GPU runs load holds every file of the packaged model, each weight the fp32
one rounded to fp16, and embeds the test sentences like the original (fp16 rounding of the weights alone)."""

from __future__ import annotations

import subprocess
import sys

import torch
from safetensors.torch import load_file

from fusedserve.model.runner import Embedder
from fusedserve.model.weights import default_model_dir
from tests.model.sentences import SENTENCES


def test_fp16_copy_of_the_packaged_model(tmp_path):
    out = tmp_path / "minilm"
    subprocess.run([sys.executable, "-m", "bench.gpu_assets", "--out", str(out)], check=True, capture_output=True)
    src = default_model_dir()
    assert sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file()) == \
        sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    full, half = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert full.keys() == half.keys()
    for name, tensor in full.items():
        assert half[name].dtype == (torch.float16 if tensor.is_floating_point() else tensor.dtype), name
        assert torch.equal(half[name], tensor.half() if tensor.is_floating_point() else tensor), name
    a, _ = Embedder.load("default", device="cpu", dtype="float32", fused=False)
    b, _ = Embedder.load(str(out), device="cpu", dtype="float32", fused=False)
    cosine = torch.nn.functional.cosine_similarity(a.embed(SENTENCES[:16]).double(), b.embed(SENTENCES[:16]).double())
    assert float(cosine.min()) >= 0.999
    assert float(cosine.min()) < 1.0  # the copy really is rounded (not the same file)
