"""Tensor-layout helpers shared by the fused backends' launchers (torch only, no Triton or CUDA code):
every launcher views its input as [rows, cols] with unit column stride and writes a fresh or caller-given
contiguous output."""

from __future__ import annotations

import torch
from torch import Tensor

# Widest row the fused LayerNorm kernels keep in registers (both backends).
MAX_COLS = 16384


def as_rows(x: Tensor, cols: int, name: str, max_cols: int = MAX_COLS) -> Tensor:
    """x viewed as [rows, cols] with unit column stride (copied only if it cannot be viewed so)."""
    if x.shape[-1] != cols:
        raise ValueError(f"{name}: last dimension is {x.shape[-1]}, expected {cols}")
    if cols > max_cols:
        raise ValueError(f"{name}: rows of {cols} elements exceed the fused kernels' limit of {max_cols}")
    if x.dim() == 2 and x.stride(1) == 1:
        return x
    x2 = x.reshape(-1, cols)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def as_vector(v: Tensor, cols: int, name: str) -> Tensor:
    if v.shape != (cols,):
        raise ValueError(f"{name}: expected shape ({cols},), got {tuple(v.shape)}")
    return v if v.stride(0) == 1 else v.contiguous()


def output_like(x2: Tensor, shape: torch.Size, out: Tensor | None, name: str) -> Tensor:
    """A fresh [rows, cols] output, or the caller's `out` (must be contiguous, same shape and dtype)."""
    if out is None:
        return torch.empty(x2.shape, dtype=x2.dtype, device=x2.device)
    if out.shape != shape or out.dtype != x2.dtype or not out.is_contiguous():
        raise ValueError(f"{name}: out must be contiguous {tuple(shape)} {x2.dtype}")
    return out.view(x2.shape)


def same_shape(name: str, x: Tensor, other: Tensor, what: str) -> None:
    if other.shape != x.shape:
        raise ValueError(f"{name}: {what} shape {tuple(other.shape)} != x shape {tuple(x.shape)}")
