"""kernels._traced_backend carries torch.compiler.assume_constant_result's mark without importing torch._dynamo at
import time: the mark must stay what the decorator sets, and Dynamo must keep the traced backend a constant."""

from __future__ import annotations

import subprocess
import sys

import torch

from fusedserve import kernels


def test_the_mark_is_the_decorators():
    def probe(op: str) -> str:
        return op

    before = dict(vars(probe))
    marked = torch.compiler.assume_constant_result(probe)
    mark = {k: v for k, v in vars(marked).items() if k not in before}
    assert mark, "the decorator set nothing on the function: the test would prove nothing"
    assert {k: getattr(kernels._traced_backend, k, None) for k in mark} == mark


def test_importing_the_kernels_leaves_dynamo_unimported():
    code = "import sys, fusedserve.kernels, fusedserve.model.packing; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_a_compiled_call_runs_the_selected_backend():
    """fullgraph torch.compile over a kernels op on the CPU: the selection's backend (the reference here) is
    traced as a constant and the compiled result matches the eager one."""
    x = torch.randn(7, 33, generator=torch.Generator().manual_seed(3))
    w, b = torch.randn(33), torch.randn(33)
    with kernels.use(kernels.reference_selection("cpu", (torch.float32,))):
        want = kernels.layer_norm(x, w, b, 1e-12)
        got = torch.compile(lambda a: kernels.layer_norm(a, w, b, 1e-12), fullgraph=True, backend="eager")(x)
    torch.testing.assert_close(got, want)
