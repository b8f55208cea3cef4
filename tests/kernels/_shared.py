"""Test bodies both fused backends share (the Triton and CUDA test modules call them with their launchers)."""

from __future__ import annotations

import torch

from fusedserve.kernels.testing import OP_SPECS, compare, float64_reference, ops_of


def check_offsets_past_two_to_the_31(launchers, op: str) -> None:
    """2^31 + a few rows' worth of bf16 elements (4.3 GB): the kernel must address the tail correctly."""
    cols = 1024
    rows = 2**31 // cols + 3
    gen = torch.Generator(device="cuda").manual_seed(9)
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, generator=gen)
    bias = torch.randn(cols, device="cuda", dtype=torch.bfloat16, generator=gen)
    if op == "bias_gelu":
        out = launchers[op](x, bias)
        tail_args = (x[-5:], bias)
    else:
        residual = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.ones(cols, device="cuda", dtype=torch.bfloat16)
        b = torch.zeros(cols, device="cuda", dtype=torch.bfloat16)
        out = launchers[op](x, residual, bias, w, b, 1e-5)
        tail_args = (x[-5:], residual[-5:], bias, w, b, 1e-5)
        del residual
    tail = out[-5:].clone()
    del out, x
    assert compare(tail, float64_reference(op, tail_args, {}), torch.bfloat16).ok


def opcheck_custom_ops(backend: str, device: str) -> None:
    """torch.library.opcheck (schema, fake tensors, AOT dispatch) on every fusedserve::<backend>_<op>."""
    gen = torch.Generator().manual_seed(5)
    for op in ops_of(backend):
        args, _ = OP_SPECS[op].make_inputs(6, 40, torch.float32, device, gen)
        if op == "add_layer_norm":
            args = (*args, False)
        elif op in ("layer_norm_gelu", "bias_gelu", "bias_residual_gelu", "linear_bias_gelu", "ffn_partials"):
            args = (*args, "none")
        custom = getattr(torch.ops.fusedserve, f"{backend}_{op}").default
        torch.library.opcheck(custom, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
