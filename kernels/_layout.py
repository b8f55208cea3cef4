"""Tensor-layout helpers shared by the fused backends' launchers (torch only, no Triton or CUDA code):
every launcher views its input as [rows, cols] with unit column stride, writes a fresh or caller-given
contiguous output, and keys its tuned launch configuration on the row count's bucket."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
from torch import Tensor

# Widest row the fused LayerNorm kernels keep in registers (both backends).
MAX_COLS = 16384


def cpu_budget() -> int:
    """The CPUs this process may use: its affinity, capped by a cgroup v2 CPU quota (a container's limit, where the
    affinity still lists every core of the node)."""
    cpus = len(os.sched_getaffinity(0))
    with contextlib.suppress(OSError, ValueError):
        # "max 100000" (no quota) or "200000 100000" (two CPUs' worth)
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    return cpus


def row_bucket(rows: int) -> int:
    """The row count's power-of-two bucket (bit length, capped at 24): the key under which both backends keep a
    tuned launch configuration (Triton's autotune key, the CUDA tuner's table), so serving's ever-changing token
    counts reuse a tuned config instead of re-tuning per batch."""
    return min(max(rows, 1).bit_length(), 24)


def common_device(name: str, tensors: tuple[Tensor | None, ...], dtypes: tuple[torch.dtype, ...]) -> torch.device:
    """The one device all given tensors (None skipped) are on, after checking each dtype is in `dtypes`."""
    device = tensors[0].device
    for t in tensors:
        if t is None:
            continue
        if t.device != device:
            raise ValueError(f"{name}: all tensors must be on one device, got {device} and {t.device}")
        if t.dtype not in dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise ValueError(f"{name}: unsupported dtype {t.dtype} ({names})")
    return device


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


def embedding_inputs(input_ids: Tensor, position_ids: Tensor, token_type_ids: Tensor, word_embeddings: Tensor,
                     position_embeddings: Tensor, token_type_embeddings: Tensor, out: Tensor | None,
                     id_dtype: torch.dtype | None = None):
    """Checked, flattened arguments of embedding_layer_norm: (ids, pos, types, word, position, token_type, y,
    shape) with the id vectors flat and contiguous (cast to `id_dtype` if given), the tables with unit column
    stride, y the [tokens, hidden] output (a fresh one or a view of `out`) and shape the caller's output shape."""
    name = "embedding_layer_norm"
    for ids in (input_ids, position_ids, token_type_ids):
        if ids.dtype not in (torch.int32, torch.int64) or ids.device != word_embeddings.device:
            raise ValueError(f"{name}: ids must be int32/int64 on {word_embeddings.device}, got {ids.dtype} on {ids.device}")
    if not input_ids.shape == position_ids.shape == token_type_ids.shape:
        raise ValueError(f"{name}: id tensors differ in shape")
    cols = word_embeddings.shape[-1]
    shape = (*input_ids.shape, cols)
    flat = [t.reshape(-1) for t in (input_ids, position_ids, token_type_ids)]
    ids, pos, types = ((t.to(id_dtype) if id_dtype else t).contiguous() for t in flat)
    rows = ids.numel()
    if out is None:
        y = torch.empty((rows, cols), dtype=word_embeddings.dtype, device=word_embeddings.device)
    elif out.shape != shape or out.dtype != word_embeddings.dtype or not out.is_contiguous():
        raise ValueError(f"{name}: out must be contiguous {shape} {word_embeddings.dtype}")
    else:
        y = out.view(rows, cols)
    tables = []
    for t, what in ((word_embeddings, "word_embeddings"), (position_embeddings, "position_embeddings"),
                    (token_type_embeddings, "token_type_embeddings")):
        if t.dim() != 2 or t.shape[1] != cols:
            raise ValueError(f"{name}: {what} must be [rows, {cols}], got {tuple(t.shape)}")
        tables.append(t if t.stride(1) == 1 else t.contiguous())
    return ids, pos, types, *tables, y, shape


def segment_arguments(name: str, x: Tensor, cu_seqlens: Tensor, out: Tensor | None,
                      out_dtype: torch.dtype, rows: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """segment_mean's (and qkv_attention's) arguments, checked the same way for both backends: x as [tokens, hidden]
    rows with unit column stride, the offsets contiguous, and the [segments, hidden] output, or [rows, hidden] when
    `rows` is given (fresh, or the caller's contiguous `out`)."""
    cu_seqlens = offsets(name, x, cu_seqlens)
    shape = (cu_seqlens.numel() - 1 if rows is None else rows, x.shape[1])
    if out is None:
        out = torch.empty(shape, dtype=out_dtype, device=x.device)
    elif out.shape != shape or out.dtype != out_dtype or not out.is_contiguous():
        raise ValueError(f"{name}: out must be a contiguous {out_dtype} tensor of shape {shape}")
    return as_rows(x, x.shape[1], name, max_cols=2**31), cu_seqlens, out


def offsets(name: str, x: Tensor, cu_seqlens: Tensor) -> Tensor:
    """cu_seqlens checked against x [tokens, hidden] (a [segments + 1] int32/int64 vector on x's device), contiguous."""
    if x.dim() != 2:
        raise ValueError(f"{name}: x must be [tokens, hidden], got {tuple(x.shape)}")
    if cu_seqlens.device != x.device:
        raise ValueError(f"{name}: cu_seqlens is on {cu_seqlens.device}, x on {x.device}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: cu_seqlens must be a [segments + 1] int32/int64 vector, got "
                         f"{tuple(cu_seqlens.shape)} {cu_seqlens.dtype}")
    return cu_seqlens.contiguous()
