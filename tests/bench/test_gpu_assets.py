"""bench.gpu_assets: the fp16 copy the GPU runs load holds every file of the packaged model, each weight the fp32
one rounded to fp16, and embeds the test sentences like the original (fp16 rounding of the weights alone); this
tree's wheel installs this tree, and the check gpu.sh runs tells a stale install apart; the baseline export is the
commit's tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from bench.gpu_assets import ROOT, build_wheel, export_tree
from fusedserve.model.runner import Embedder
from fusedserve.model.weights import default_model_dir
from tests.model.sentences import SENTENCES


def test_fp16_copy_of_the_packaged_model(tmp_path):
    out = tmp_path / "minilm"
    subprocess.run([sys.executable, "-m", "bench.gpu_assets", "--out", str(out), "--no-wheel"], check=True,
                   capture_output=True)
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


def test_the_wheel_installs_this_tree_and_the_check_sees_any_other(tmp_path):
    """build_wheel's wheel, installed with pip --target as the GPU machine installs it, is this tree file for file
    (--check-installed passes); an installed file edited or missing afterwards is named, and the check fails."""
    wheel = build_wheel(tmp_path / "wheels")
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
                    str(wheel)], check=True, capture_output=True)

    def check() -> subprocess.CompletedProcess:
        # from a folder holding neither the tree nor fusedserve: the install first on the path, then the tree (bench)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(site), str(ROOT)))}
        return subprocess.run([sys.executable, "-m", "bench.gpu_assets", "--check-installed"], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=120)

    clean = check()
    assert clean.returncode == 0, clean.stderr
    (site / "fusedserve" / "kernels" / "spec.py").write_text("# not this tree's\n", encoding="utf-8")
    (site / "fusedserve" / "server" / "app.py").unlink()
    stale = check()
    assert stale.returncode != 0
    assert "fusedserve.kernels: spec.py differs" in stale.stderr and "fusedserve.server: app.py is not installed" \
        in stale.stderr


def test_the_baseline_export_holds_the_commit_tree(tmp_path):
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    out = tmp_path / "baseline"
    (out / "stale").mkdir(parents=True)  # emptied first
    record = export_tree("HEAD", out)
    assert record == {"git_sha": head, "git_dirty": False}
    assert json.loads((out / "source.json").read_text()) == record
    # the commit's fusedserve as its wheel installs it, and its bench/ without the results
    names = sorted(p.name for p in out.iterdir())
    assert names[:2] == ["bench", "fusedserve"] and names[-1] == "source.json" and len(names) == 4, names
    assert names[2].startswith("fusedserve-") and names[2].endswith(".dist-info")
    assert (out / "fusedserve" / "server" / "__main__.py").is_file() and not (out / "bench" / "results").exists()
    committed = subprocess.run(["git", "show", "HEAD:kernels/spec.py"], cwd=ROOT, capture_output=True, check=True,
                               timeout=10).stdout
    assert (out / "fusedserve" / "kernels" / "spec.py").read_bytes() == committed
    # what the compare suites run from there is that tree's: the server module resolves inside `out`
    found = subprocess.run([sys.executable, "-c", "import fusedserve.server.__main__ as m; print(m.__file__)"],
                           cwd=out, env={**os.environ, "PYTHONPATH": str(out)}, capture_output=True, text=True,
                           timeout=60)
    assert found.returncode == 0 and found.stdout.strip().startswith(str(out)), found.stdout + found.stderr
