"""Accuracy checks shared by the registry's startup self-test and the test suite: the one tolerance
table, the error measures (relative L2 error and max abs error against a float64 reference), and a
check of one implementation on fresh random inputs
(the inputs come from kernels.spec).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from fusedserve.kernels.spec import OP_SPECS, ROWWISE_OPS, ops_of  # noqa: F401  (the tests' shape specs)

# dtype -> (max relative L2 error ||out-ref||/||ref||, elementwise atol, elementwise rtol).
# Set from what rounding the output once to the dtype costs (fp16 eps 2^-10, bf16 2^-7) with headroom
# for fp32 accumulation order; a fused kernel must be as good as the reference cast once. float64 is for the oracle
# itself (the reference evaluated in float64) against the ops' formulas written out again: the same math in another
# order, eps 2^-53 with headroom for sums over thousands of columns.
TOLERANCES: dict[torch.dtype, tuple[float, float, float]] = {
    torch.float32: (1e-5, 1e-5, 1e-5),
    torch.float16: (1e-3, 2e-3, 2e-3),
    torch.bfloat16: (8e-3, 1.6e-2, 1.6e-2),
    torch.float64: (1e-12, 1e-12, 1e-12),
}


@dataclass(frozen=True)
class ErrorReport:
    rel_l2: float
    max_abs: float
    ok: bool
    reason: str

    def __str__(self) -> str:
        verdict = "ok" if self.ok else f"FAIL ({self.reason})"
        return f"rel_l2={self.rel_l2:.2e} max_abs={self.max_abs:.2e} {verdict}"


def compare(out: Tensor, ref: Tensor, dtype: torch.dtype) -> ErrorReport:
    """Compare an op's output with a float64 reference. Non-finite values must sit exactly where the
    reference has the same non-finite value; a NaN anywhere else fails."""
    rel_tol, atol, rtol = TOLERANCES[dtype]
    if out.shape != ref.shape:
        return ErrorReport(float("inf"), float("inf"), False, f"shape {tuple(out.shape)} != {tuple(ref.shape)}")
    o, r = out.detach().to("cpu", torch.float64), ref.detach().to("cpu", torch.float64)
    o_finite, r_finite = torch.isfinite(o), torch.isfinite(r)
    if not torch.equal(o_finite, r_finite):
        bad = int((o_finite != r_finite).sum())
        return ErrorReport(float("nan"), float("nan"), False, f"{bad} elements differ in finiteness (NaN/Inf)")
    if not torch.equal(torch.nan_to_num(o[~o_finite], nan=0.0), torch.nan_to_num(r[~r_finite], nan=0.0)):
        return ErrorReport(float("nan"), float("nan"), False, "non-finite values differ")
    o, r = o[o_finite], r[r_finite]
    if r.numel() == 0:
        return ErrorReport(0.0, 0.0, True, "")
    diff = (o - r).abs()
    max_abs = float(diff.max())
    # The denominator is floored at an RMS of 1 (the scale of these ops' outputs): a near-zero reference
    # (GELU's far negative tail, where fp32 1 + erf cancels) must not turn tiny absolute differences into
    # huge relative ones. Above that floor this is exactly ||out - ref|| / ||ref||.
    ref_norm = max(float(r.norm()), r.numel() ** 0.5)
    rel_l2 = float((o - r).norm()) / ref_norm
    if rel_l2 > rel_tol:
        return ErrorReport(rel_l2, max_abs, False, f"rel_l2 {rel_l2:.2e} > {rel_tol:.0e}")
    excess = diff - (atol + rtol * r.abs())
    if bool((excess > 0).any()):
        return ErrorReport(rel_l2, max_abs, False, f"{int((excess > 0).sum())} elements beyond atol={atol} rtol={rtol}")
    return ErrorReport(rel_l2, max_abs, True, "")


def to_float64(value):
    if isinstance(value, Tensor) and value.is_floating_point():
        return value.detach().to("cpu", torch.float64)
    if isinstance(value, Tensor):
        return value.detach().cpu()
    return value


def float64_reference(op: str, args: tuple, kwargs: dict) -> Tensor:
    """The op's reference evaluated in float64 on the CPU, on exactly the (already rounded) inputs."""
    return OP_SPECS[op].reference(*map(to_float64, args), **kwargs)


def check_op(fn: Callable[..., Tensor], op: str, rows: int, cols: int, dtype: torch.dtype,
             device: torch.device | str, seed: int,
             oracle: Callable[[str, tuple, dict], Tensor] = float64_reference) -> ErrorReport:
    """Run `fn` (a backend's implementation of `op`) on fresh random inputs into a NaN-poisoned output
    and compare it with `oracle` (op, args, kwargs) -> the expected output: the float64 reference."""
    gen = torch.Generator().manual_seed(seed)
    spec = OP_SPECS[op]
    args, kwargs = spec.make_inputs(rows, cols, dtype, device, gen)
    shape, out_dtype = spec.output(args, rows, cols, dtype)
    out = torch.full(shape, float("nan"), dtype=out_dtype, device=device)
    result = fn(*args, **kwargs, out=out)
    if result.data_ptr() != out.data_ptr():
        return ErrorReport(float("nan"), float("nan"), False, "did not write into the out= tensor")
    return compare(result, oracle(op, args, kwargs), dtype)
