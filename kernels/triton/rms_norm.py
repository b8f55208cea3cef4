"""Triton RMSNorm (transformers' Qwen2/Qwen3 order): launcher for the shared norm kernel's RMS entry, no residual."""

from __future__ import annotations

from torch import Tensor

from fusedserve.kernels.triton._common import as_rows, as_vector, check_device, output_like
from fusedserve.kernels.triton._norm import launch_rms_norm


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, *, out: Tensor | None = None) -> Tensor:
    check_device("rms_norm", x, weight)
    cols = x.shape[-1]
    x2 = as_rows(x, cols, "rms_norm")
    y = output_like(x2, x.shape, out, "rms_norm")
    launch_rms_norm(x2, None, as_vector(weight, cols, "rms_norm weight"), y, None, eps)
    return out if out is not None else y.view(x.shape)
