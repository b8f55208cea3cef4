"""The packed batch, the attention modes and pooling: how every family's encoder is fed and read. A family's layers
(model/bert.py, composed from model/layers.py) run token-wise work on flattened [tokens, hidden] tensors through the
fused `kernels.*` ops.

Two layouts: an encoder's `forward` takes a padded [batch, seq] batch; `forward_packed` takes a `Packed` batch, the
real tokens of every sequence back to back ([tokens, hidden], no padding), so GEMMs and the fused ops touch real
tokens only. Attention in the packed layout either scatters q/k/v into a padded [batch, seq] block for SDPA
and gathers the context back ("pad", works everywhere and inside CUDA graphs; attention is a few per cent
of an encoder's FLOPs at these lengths), or attends within each sequence's offsets ("varlen": torch's
variable-length flash attention on CUDA, one SDPA per sequence on the CPU), or runs the QKV projection and the
attention of each sequence as one fused op ("fused", kernels.qkv_attention).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from fusedserve import kernels
from fusedserve.model.api import Rows


@dataclass
class Packed:
    """A batch of sequences packed back to back. Tensors may be longer than the real token count (CUDA-graph
    buckets): such filler tokens have pad_index == batch * seq (a scratch row) and seq_index == batch."""

    input_ids: Tensor       # [T] int64
    position_ids: Tensor    # [T] int64
    token_type_ids: Tensor  # [T] int64
    pad_index: Tensor       # [T] int64: row of each token in the padded [batch * seq] layout (+1 scratch row)
    gather_index: Tensor    # [T] int64: pad_index clamped to a real row (filler tokens read row 0)
    seq_index: Tensor       # [T] int64: the sequence of each token (filler: batch, a scratch slot)
    lengths: Tensor         # [batch] int64, >= 1 (filler sequences: 1)
    batch: int
    seq: int                # >= the longest sequence
    cu_seqlens: Tensor | None = None  # [batch + 1] int32, for varlen attention
    dense: bool = False  # every row has exactly `seq` tokens, no filler: attention needs no mask or scatter

    @property
    def attn_mask(self) -> Tensor:
        # [batch, 1, 1, seq] bool, True = attend; derived on the device so a graph replay needs only the lengths
        positions = torch.arange(self.seq, device=self.lengths.device)
        return (positions[None, :] < self.lengths[:, None])[:, None, None, :]

    FIELDS = ("input_ids", "position_ids", "token_type_ids", "pad_index", "gather_index", "seq_index")

    @staticmethod
    def host_buffers(rows: Rows | list[list[int]], tokens: int, batch: int, seq: int, pad_token_id: int = 0, *,
                     position_offset: int = 0, pair_types: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """The packed batch as CPU tensors, Packed.fill's layout: [6, tokens] int64 (one row per Packed.FIELDS;
        filler tokens point at the scratch row and scratch sequence), [batch] lengths (filler sequences: 1) and
        [batch + 1] int32 cu_seqlens."""
        flat = torch.empty((len(Packed.FIELDS), tokens), dtype=torch.long)
        lengths, cu_seqlens = torch.empty(batch, dtype=torch.long), torch.empty(batch + 1, dtype=torch.int32)
        Packed.fill(rows, flat.numpy(), lengths.numpy(), seq, pad_token_id, cu_seqlens=cu_seqlens.numpy(),
                    position_offset=position_offset, pair_types=pair_types)
        return flat, lengths, cu_seqlens

    @staticmethod
    def fill(rows: Rows | list[list[int]], flat: np.ndarray, lengths: np.ndarray, seq: int, pad_token_id: int = 0, *,
             cu_seqlens: np.ndarray, position_offset: int = 0, pair_types: bool = False) -> None:
        """Write the packed batch into host arrays: flat [6, tokens] int64 (Packed.FIELDS), lengths [batch] int64
        and cu_seqlens [batch + 1] int32 (varlen attention's sequence offsets; filler sequences are zero-length, so
        attention leaves their rows alone). numpy, not torch: this runs on the host
        for every batch, and a few dozen small torch ops cost more than a small model's whole graph replay; the ids
        arrive as one array (model.api.Rows) and are copied once. Everything but the ids and token types follows
        from the rows' lengths, and for batches of up to LAYOUT_CACHE_TOKENS tokens it comes from a cache keyed by
        them (small batches of the same lengths recur; at that size the packing costs more than the copy).
        position_offset: added to each token's position (RoBERTa's start past the padding index). pair_types: a
        text pair's row gets token type 1 from its second text on (Rows.second), as the tokenizer's pair encoding
        says (a cross-encoder with token types); every other token's type is 0."""
        rows = rows if isinstance(rows, Rows) else Rows.of(rows)
        n, real, tokens, batch = len(rows), rows.tokens, flat.shape[1], len(lengths)
        if tokens < real or batch < n or seq < rows.longest:
            raise ValueError(f"bucket ({tokens}, {batch}, {seq}) too small for {real} tokens in {n} rows")
        ids = flat[0]
        ids[:real] = rows.ids
        ids[real:] = pad_token_id
        row_lengths = np.ascontiguousarray(rows.lengths, dtype=np.int64)
        if tokens <= LAYOUT_CACHE_TOKENS:
            index, full_lengths, cu = _cached_layout(row_lengths.tobytes(), tokens, batch, seq, position_offset)
            flat[1:] = index
            lengths[:] = full_lengths
            cu_seqlens[:] = cu
        else:
            _write_layout(row_lengths, flat[1:], lengths, cu_seqlens, seq, position_offset)
        if pair_types and rows.second is not None:
            positions, types, seq_index = (flat[Packed.FIELDS.index(f)] for f in
                                           ("position_ids", "token_type_ids", "seq_index"))
            np.greater_equal(positions[:real] - position_offset, rows.second[seq_index[:real]], out=types[:real],
                             casting="unsafe")

    @classmethod
    def from_buffers(cls, flat: Tensor, lengths: Tensor, seq: int, *, dense: bool = False,
                     cu_seqlens: Tensor | None = None) -> Packed:
        """A Packed made of views of `host_buffers`' layout, allocating nothing: a CUDA graph captured on it
        reads only the static buffers its owner keeps (on any device)."""
        return cls(*flat, lengths, lengths.shape[0], seq, cu_seqlens, dense)

    @classmethod
    def from_rows(cls, rows: Rows | list[list[int]], device: torch.device | str, *, tokens: int | None = None,
                  batch: int | None = None, seq: int | None = None, pad_token_id: int = 0, position_offset: int = 0,
                  pair_types: bool = False) -> Packed:
        """Pack token-id rows, optionally into a larger (tokens, batch, seq) bucket."""
        rows = rows if isinstance(rows, Rows) else Rows.of(rows)
        real = rows.tokens
        tokens, batch, seq = tokens or real, batch or len(rows), seq or rows.longest
        flat, lengths, cu_seqlens = cls.host_buffers(rows, tokens, batch, seq, pad_token_id,
                                                     position_offset=position_offset, pair_types=pair_types)
        return cls.from_buffers(flat.to(device), lengths.to(device), seq, dense=tokens == real == batch * seq,
                                cu_seqlens=cu_seqlens.to(device))


# Batches of up to this many tokens take everything but their ids from _cached_layout (Packed.fill): at these sizes
# the packing is a few dozen numpy calls on tiny arrays, about as long as a small model's graph replay, and single
# requests of the same length recur. 256 entries of at most 5 x 512 int64 each: about 5 MiB.
LAYOUT_CACHE_TOKENS = 512


@functools.lru_cache(maxsize=256)
def _cached_layout(lengths: bytes, tokens: int, batch: int, seq: int,
                   position_offset: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """_write_layout's arrays for rows of these lengths (int64 bytes) in this bucket, read-only."""
    index = np.empty((len(Packed.FIELDS) - 1, tokens), dtype=np.int64)
    full_lengths, cu = np.empty(batch, dtype=np.int64), np.empty(batch + 1, dtype=np.int32)
    _write_layout(np.frombuffer(lengths, dtype=np.int64), index, full_lengths, cu, seq, position_offset)
    for array in (index, full_lengths, cu):
        array.flags.writeable = False
    return index, full_lengths, cu


def _write_layout(lengths: np.ndarray, index: np.ndarray, full_lengths: np.ndarray, cu: np.ndarray, seq: int,
                  position_offset: int) -> None:
    """A packed batch's arrays that follow from its rows' lengths: index [5, tokens] (Packed.FIELDS after the ids:
    positions, token types 0, pad_index, gather_index, seq_index; filler tokens at the scratch row and scratch
    sequence), full_lengths [batch] (filler sequences 1) and cu [batch + 1] int32 (filler sequences of zero
    length)."""
    n, batch = len(lengths), len(full_lengths)
    ends = np.cumsum(lengths)
    real = int(ends[-1]) if n else 0
    positions, types, pad_index, gather_index, seq_index = index
    row_of_token = np.repeat(np.arange(n, dtype=np.int64), lengths)
    np.subtract(np.arange(real, dtype=np.int64), np.repeat(ends - lengths, lengths), out=positions[:real])
    positions[real:] = 0
    types[:] = 0
    np.multiply(row_of_token, seq, out=pad_index[:real])
    pad_index[:real] += positions[:real]
    if position_offset:
        positions += position_offset
    pad_index[real:] = batch * seq
    np.minimum(pad_index, batch * seq - 1, out=gather_index)
    seq_index[:real] = row_of_token
    seq_index[real:] = batch
    full_lengths[:n] = lengths
    full_lengths[n:] = 1
    cu[0] = 0
    cu[1: n + 1] = ends
    cu[n + 1:] = real


@functools.cache
def varlen_attention():
    """Variable-length flash attention over packed rows, (q, k, v, cu_q, cu_k, max_q, max_k) -> context, or None where
    torch has none (a torch without torch.nn.attention.varlen, the API this path is written and tested against, is
    taken as none). It is the flash branch of torch.nn.attention.varlen.varlen_attn for these arguments (no dropout,
    not causal, default scale), called directly: that wrapper is a torch.library custom op whose first call imports
    torch._dynamo (seconds of every start-up) and which allocates an RNG state per call. Newer torch sends rows
    longer than 128 tokens on SM 9.x/10.x to cuDNN's attention where cuDNN >= 9.18; this stays on flash, as the
    encoder's SDPA calls do (flash needs no plan per new shape: docs/decisions/0014-sdpa-without-cudnn-attention.md,
    which also records that flash gives varlen_attn's own results)."""
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:  # found, not imported: that imports dynamo
        return None
    flash = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if flash is None or not torch.backends.cuda.is_flash_attention_available():
        return None

    def varlen(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int) -> Tensor:
        return flash(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, False, False)[0]
    return varlen


ATTENTIONS = ("auto", "pad", "varlen", "fused")
# With attention="fused", batches of at most this many tokens (the serving buckets of a single short request or a
# few) run each layer as four kernels (model/bert.py, Layer._few_token_layer); larger ones run the varlen path where it
# runs (faster than qkv_attention at 128-token sequences), else qkv_attention + the usual blocks.
FUSED_LAYER_TOKENS = 64
# the few-token layer's ops (FUSED_LAYER_TOKENS): auto attention keeps "fused" only where all run on a fused backend
FEW_TOKEN_OPS = ("attention_partials", "ffn_partials", "partial_add_layer_norm")
OFFSET_ATTENTIONS = ("varlen", "fused")  # attend within cu_seqlens: no padded block, filler sequences of length 0


def varlen_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """torch's varlen attention runs here: fp16/bf16 on CUDA, and varlen_attention found in this torch. (The CPU's
    "varlen" is sequence_attention, which runs on any CPU.)"""
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and varlen_attention() is not None


# SDPA's backends for the padded and equal-length batches: not cuDNN's attention, which torch prefers on Hopper and
# which builds an execution plan for every new shape: every eager batch at a new length (a kernel-timed sample, a
# batch outside the CUDA-graph buckets) and every graph capture paid one, tens of milliseconds, while requests waited
# (docs/decisions/0014-sdpa-without-cudnn-attention.md). Flash and memory-efficient attention run any length without
# one. torch keeps the enabled backends in process-wide flags, which `sdpa_kernel` sets on entry and restores on exit:
# the lock keeps one thread's exit (a second model's batcher, the verifier's reference copy) from restoring cuDNN
# while another thread is between its entry and its SDPA call.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_SDPA_FLAGS = threading.Lock()


@contextlib.contextmanager
def pinned_sdpa() -> Iterator[None]:
    """SDPA_BACKENDS for the block, under the flags lock; traced by torch.compile the backend is chosen at compile
    time, and Dynamo cannot enter a lock."""
    lock = contextlib.nullcontext() if torch.compiler.is_compiling() else _SDPA_FLAGS
    with lock, sdpa_kernel(SDPA_BACKENDS):
        yield


def padded_attention(qkv: Tensor, batch: int, seq: int, heads: int, attn_mask: Tensor | None) -> Tensor:
    """SDPA over a padded block: qkv [batch * seq, 3 * hidden] (query, key, value stacked) -> context
    [batch * seq, hidden]; attn_mask [batch, 1, 1, seq] bool (True = attend) or None for rows of equal length."""
    q, k, v = qkv.view(batch, seq, 3, heads, -1).permute(2, 0, 3, 1, 4)
    with pinned_sdpa():
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    return ctx.transpose(1, 2).reshape(batch * seq, -1)


def sequence_attention(qkv: Tensor, cu_seqlens: Tensor, heads: int) -> Tensor:
    """The CPU's varlen attention: SDPA over each sequence of a packed batch on its own, qkv [T, 3 * hidden] ->
    context [T, hidden] (rows past the last sequence: zeros). torch has no variable-length attention on the CPU, and a
    padded block attends every row over the longest row's length, so at a CPU batch's mixed lengths one unmasked SDPA
    per sequence wins (decision 0021). A CPU batch holds a few dozen sequences at most (CPU_BATCH_TOKENS): the loop's
    microseconds per sequence are noise against its attention; nested tensors' SDPA, the loop-free form, has no fused
    CPU kernel."""
    out = qkv.new_empty((qkv.shape[0], qkv.shape[1] // 3))
    bounds = cu_seqlens.tolist()
    out[bounds[-1]:].zero_()
    with pinned_sdpa():
        for start, end in zip(bounds, bounds[1:]):
            if end > start:
                q, k, v = qkv[start:end].view(end - start, 3, heads, -1).permute(1, 2, 0, 3)
                out[start:end] = F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(end - start, -1)
    return out


def packed_attention(qkv: Tensor, p: Packed, heads: int, attention: str) -> Tensor:
    """Attention of a packed batch, qkv [T, 3 * hidden] -> context [T, hidden]: a dense batch as the padded block
    it is; "varlen": within cu_seqlens (flash attention on CUDA, sequence_attention on the CPU); else ("pad")
    scattered into a padded block for SDPA and gathered back."""
    if p.dense:  # rows of equal length back to back: the packed layout is the padded one, unmasked
        return padded_attention(qkv, p.batch, p.seq, heads, None)
    if attention == "varlen":
        if qkv.device.type == "cpu":
            return sequence_attention(qkv, p.cu_seqlens, heads)
        q, k, v = qkv.view(qkv.shape[0], 3, heads, -1).unbind(1)
        return varlen_attention()(q, k, v, p.cu_seqlens, p.cu_seqlens, p.seq, p.seq).reshape(qkv.shape[0], -1)
    padded = qkv.new_zeros((p.batch * p.seq + 1, qkv.shape[1])).index_copy_(0, p.pad_index, qkv)
    return padded_attention(padded[:-1], p.batch, p.seq, heads, p.attn_mask).index_select(0, p.gather_index)


def resolve_attention(attention: str, device: torch.device, dtype: torch.dtype) -> str:
    """The attention mode to start from. auto -> "fused" where torch's variable-length flash attention runs (fp16/bf16
    on CUDA, a torch built with it): the few-token layer for batches of at most FUSED_LAYER_TOKENS tokens, the
    varlen path above them (faster than varlen alone for a single short request: docs/performance.md, encoder suite);
    "varlen" on the CPU (sequence_attention: no padded block); "pad" elsewhere. The kernel path takes auto's "fused"
    back to "varlen" when the few-token ops did not land on a fused backend (FEW_TOKEN_OPS;
    model.kernel_path.KernelPath.attention_for), since their reference path is slower than varlen. "varlen" (no padded
    block, no mask) and "fused" (the QKV projection and attention of each sequence as one op, `kernels.qkv_attention`,
    where varlen does not run) are taken as asked."""
    usable = varlen_runs(device, dtype)
    if attention == "auto":
        return "fused" if usable else "varlen" if device.type == "cpu" else "pad"
    if attention == "varlen" and not usable and device.type != "cpu":
        raise ValueError(f"varlen attention needs the CPU, or fp16/bf16 on CUDA and a torch built with flash "
                         f"attention (device {device}, dtype {dtype}, torch {torch.__version__})")
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
    return attention


def check_offsets(p: Packed, attention: str, dtype: torch.dtype, what: str) -> None:
    """What attention over cu_seqlens (`what`: whose, for the message) needs of a packed batch: varlen where it runs
    (the one check, raising with the reason) and the batch's offsets."""
    if attention == "varlen":
        resolve_attention("varlen", p.input_ids.device, dtype)
    if p.cu_seqlens is None:
        raise ValueError(f"{what} needs the batch's cu_seqlens (Packed.from_rows sets them)")


def packed_mean_pool(hidden: Tensor, p: Packed, normalize: bool) -> Tensor:
    """Mean over each sequence's tokens of a packed batch: [batch, hidden] float32 (filler tokens and filler
    sequences fall into scratch rows)."""
    if p.cu_seqlens is not None:  # one kernel on a fused backend; the reference never syncs (graphs capture it)
        pooled = kernels.segment_mean(hidden, p.cu_seqlens).to(torch.float32)
    else:  # a Packed built without offsets
        sums = torch.zeros((p.batch + 1, hidden.shape[1]), dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, p.seq_index, hidden.float())
        pooled = sums[: p.batch] / p.lengths[:, None].to(torch.float32)
    return F.normalize(pooled, p=2, dim=1) if normalize else pooled


def mean_pool(hidden: Tensor, attention_mask: Tensor, normalize: bool) -> Tensor:
    """Mean over real tokens (as sentence-transformers' Pooling), optionally L2-normalized: [batch, hidden]."""
    hidden = hidden.float()
    mask = attention_mask.to(hidden.dtype).unsqueeze(-1)
    pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
    return F.normalize(pooled, p=2, dim=1) if normalize else pooled
