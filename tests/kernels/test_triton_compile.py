"""The few-token layer's, the RMSNorm and the packed attention kernels compile for Hopper (sm_90) with Triton's own
compiler and ptxas, on a machine without a GPU (kernels/triton/compile_check.py): the interpreter that runs the
kernels in CI never compiles them, and one compile-only error (a variable of two types across a runtime branch)
reached the H200 that way. So do the kernels that can be launched with programmatic dependent launch, with it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU every kernel is compiled for real by the GPU tests")
@pytest.mark.slow
def test_few_token_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-m", "fusedserve.kernels.triton.compile_check", "--arch", "90"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    compiled = [line for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert len(compiled) >= 30 and "all compiled" in result.stdout, result.stdout
    # with programmatic dependent launch: every kernel it covers, each PTX checked for the wait and the release
    pdl = {line.split()[1] for line in compiled if " pdl:" in line}
    assert pdl == {"qkv_attention", "ffn_partials", "partial_add_layer_norm", "embedding_layer_norm",
                   "segment_mean", "add_rms_norm", "relative_attention", "rotary_attention",
                   "disentangled_attention"}, result.stdout


def test_the_check_refuses_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "fusedserve.kernels.triton.compile_check"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "unset TRITON_INTERPRET" in result.stderr


def test_the_pdl_check_rejects_a_load_before_the_wait():
    from fusedserve.kernels.triton.compile_check import _check_pdl_ptx

    _check_pdl_ptx("mov.u32 %r1, %ctaid.x;\ngriddepcontrol.wait;\ngriddepcontrol.launch_dependents;\nld.global.b32 x;")
    with pytest.raises(AssertionError, match="precedes"):
        _check_pdl_ptx("ld.global.b32 x;\ngriddepcontrol.wait;\ngriddepcontrol.launch_dependents;")
    with pytest.raises(AssertionError, match="lacks griddepcontrol.launch_dependents"):
        _check_pdl_ptx("griddepcontrol.wait;\nld.global.b32 x;")
