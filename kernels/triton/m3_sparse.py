"""Triton BGE-M3 sparse weights: per token of a packed batch, relu(x . weight + bias) kept only where the token is the
largest of its (sequence, token id) group and its id is not a dropped special token, in two kernels and no
[sequences, vocabulary] buffer.

Why: FlagEmbedding's M3Embedder scatters the per-token weights into a [sequences, vocabulary] tensor with an amax
per token id (250,002 columns for BGE-M3: a zeroed 64 MB fp32 buffer at 64 sequences, then its nonzeros read back)
and zeroes the special tokens' columns. Here each token learns whether it wins its group by comparing itself with
the tokens of its own sequence: the output is [tokens] float32, whose nonzeros are exactly the sparse dict's entries.

- Keys (first kernel): one program per BLOCK_T tokens computes their weights, a GEMV over the hidden width in fp32
  (products and sums of the inputs made fp32, one sum per row at the end), and writes each as an int32 order key:
  relu(w)'s fp32 bit pattern (for floats >= 0 the int32 order is the float order; relu makes -0.0 +0.0), a NaN as the
  canonical NaN 0x7FC00000 (above +inf's bits: a NaN outranks every number, so it is kept, never dropped, as the
  dense scatter's amax keeps it), and -1 for a dropped id or a token outside the offsets (whose row is never read).
- Selection (second kernel): one program per BLOCK_T tokens finds the sequences of its first and last real tokens
  by binary searches of cu_seqlens (ceil(log2 B) loads, nothing on the host: it runs inside CUDA graphs), then scans
  the tokens of those sequences in blocks of BLOCK_J, as a [BLOCK_T, BLOCK_J] comparison: token j outranks token t
  if it is in t's sequence, has t's id, and a larger key, or an equal key at a lower index. A token outranked by none
  is its group's representative and writes its weight (a key of -1 writes 0); every other token writes 0. The scan
  runs in three parts so that the index is compared only where it can decide: the tokens before the tile win on an
  equal key (key_j >= key_t), those after it on a larger one (key_j >= key_t + 1), the tile's own block by index; a
  token past the range is read as key -1, which wins against no kept token, so no block needs a mask of its own.
  A tile within one sequence (every tile of a long one) needs no sequence bounds; a tile over several finds each
  row's sequence by a vector binary search and tests the bounds per pair. O(L^2) comparisons per sequence of L
  tokens (four integer operations each on a long one), no atomics, deterministic; tokens outside the offsets write
  0 and are compared with nothing.
- The keys live in a [tokens] int32 scratch between the two launches (the second kernel reads other tiles' keys, so
  it cannot overwrite them in place). Both kernels take programmatic dependent launch where the GPU has it: the
  second waits in pdl_sync for the first's keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusedserve.kernels._layout import offsets
from fusedserve.kernels.triton._common import check_device, deferrable, pdl_args, pdl_sync

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ID_DTYPES = (torch.int32, torch.int64)
_NAN_BITS = tl.constexpr(0x7FC00000)  # the canonical fp32 NaN: as an int32, above every other non-negative float
BLOCK_J = 64  # keys compared per step of the selection scan
SELECT_ROWS, SELECT_WARPS = 64, 4  # tokens per program of the selection kernel


@triton.jit
def _offset(cu_ptr, i, T):
    """cu_seqlens[i] clamped to [0, T], as int32 (T < 2^31 tokens); i a scalar or a vector of indices."""
    return tl.minimum(tl.maximum(tl.load(cu_ptr + i), 0), T).to(tl.int32)


@deferrable
@triton.jit(do_not_specialize=["T", "B", "K"])  # counts: see _common.autotune
def _m3_keys_kernel(x_ptr,  # [T, H] hidden states: the packed sequences' tokens
                    w_ptr,  # [H] sparse_linear's weight row
                    b_ptr,  # [1] float32 sparse_linear's bias
                    ids_ptr,  # [T] int32/int64 token ids
                    cu_ptr,  # [B + 1] int32/int64 sequence offsets
                    drop_ptr,  # [K] int32/int64 dropped token ids
                    key_ptr,  # [T] int32 out: each token's order key
                    T, H, B, K, stride_xt, stride_xh, stride_w,
                    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_sync(USE_PDL)  # x, the ids and the offsets may be written by the kernels before
    # the tile's real rows: [start, end), its rows within [cu[0], cu[B]) (the others are filler, never read)
    tile = tl.program_id(0).to(tl.int64) * BLOCK_T
    start = tl.maximum(tile, _offset(cu_ptr, 0, T))
    end = tl.minimum(tile + BLOCK_T, _offset(cu_ptr, B, T))
    rows = tile + tl.arange(0, BLOCK_T)
    real = (rows >= start) & (rows < end)
    ids = tl.load(ids_ptr + rows, mask=real, other=0)
    kept = real
    for k in range(0, K):
        kept = kept & (ids != tl.load(drop_ptr + k))
    # w = x[t] . weight + bias, fp32 products summed per row once the hidden width is walked; rows not kept unread
    cols = tl.arange(0, BLOCK_H)
    x_ptrs = x_ptr + rows[:, None] * stride_xt + cols[None, :].to(tl.int64) * stride_xh
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for h in range(0, tl.where(start < end, H, 0), BLOCK_H):  # nothing for a tile of filler rows
        inside = h + cols < H
        x = tl.load(x_ptrs, mask=kept[:, None] & inside[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + (h + cols) * stride_w, mask=inside, other=0.0).to(tl.float32)
        acc += x * w[None, :]
        x_ptrs += BLOCK_H * stride_xh
    weight = tl.sum(acc, axis=1) + tl.load(b_ptr).to(tl.float32)
    # key = the bits of relu(w) (+0.0 for w <= 0), the canonical NaN for a NaN, -1 for a token not kept
    key = tl.where(weight > 0.0, weight, 0.0).to(tl.int32, bitcast=True)
    key = tl.where(weight != weight, _NAN_BITS, key)
    tl.store(key_ptr + rows, tl.where(kept, key, -1), mask=rows < T)


@triton.jit
def _sequence(cu_ptr, row, B, T, STEPS):
    """The sequence of `row` (a scalar or a vector): the last b < B with cu[b] <= row, offsets non-decreasing, by
    STEPS >= log2(B) halvings; a row outside [cu[0], cu[B]) gets some b in [0, B - 1]. lo and hi stay within
    [-1, B - 1] with lo >= 0, so every offset read is within [0, B - 1] (cu[0] where B is 0)."""
    lo = row.to(tl.int32) * 0
    hi = lo + (B - 1)
    for _ in range(STEPS):
        mid = (lo + hi + 1) // 2
        below = _offset(cu_ptr, mid, T) <= row
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid - 1)
    return lo


@triton.jit
def _hits(ids_ptr, key_ptr, start, stop, own_id, threshold, lower, upper, hits, BOUNDS: tl.constexpr,
          BLOCK_J: tl.constexpr):
    """hits | (j in [start, start + BLOCK_J) and before `stop` outranks the row: the same id and key_j >= threshold,
    and j within the row's sequence [lower, upper) where BOUNDS). A token past `stop` is read as key -1, below the
    threshold of every kept row (>= 0): it never wins, with no mask of its own."""
    js = start + tl.arange(0, BLOCK_J)
    inside = js < stop
    other_id = tl.load(ids_ptr + js, mask=inside, other=0)
    other_key = tl.load(key_ptr + js, mask=inside, other=-1)
    wins = (other_id[None, :] == own_id[:, None]) & (other_key[None, :] >= threshold)
    if BOUNDS:
        wins = wins & (js[None, :] >= lower[:, None]) & (js[None, :] < upper[:, None])
    return hits | wins


@triton.jit
def _outranked(ids_ptr, key_ptr, rows, own_id, own_key, lower, upper, first, last, tile,
               BOUNDS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_J: tl.constexpr):
    """1 for each row outranked by a token j in [first, last) of its sequence ([lower, upper), tested where BOUNDS)
    with its id: a larger key, or an equal key at a lower index; else 0 (and anything for a row not kept: its output
    is 0 whatever this says). The tokens before the tile's rows ([tile, tile + BLOCK_T)) are lower than each of them
    and win on an equal key (key_j >= key_t), those after it only on a larger one (key_j >= key_t + 1), so the index
    is compared in the tile's own block only. Each pair's verdict is OR-ed elementwise, reduced over j once."""
    hits = tl.zeros((BLOCK_T, BLOCK_J), dtype=tl.int1)
    own = tl.minimum(tl.maximum(tile, first), last)  # the tile's own rows within [first, last): [own, own_end)
    own_end = tl.maximum(tl.minimum(tile + BLOCK_T, last), own)
    for start in range(first, own, BLOCK_J):
        hits = _hits(ids_ptr, key_ptr, start, own, own_id, own_key[:, None], lower, upper, hits, BOUNDS, BLOCK_J)
    for start in range(own, own_end, BLOCK_J):  # j outranks t: key_j >= key_t + (j >= t)
        js = start + tl.arange(0, BLOCK_J)
        threshold = own_key[:, None] + (js[None, :] >= rows[:, None]).to(tl.int32)
        hits = _hits(ids_ptr, key_ptr, start, own_end, own_id, threshold, lower, upper, hits, BOUNDS, BLOCK_J)
    for start in range(own_end, last, BLOCK_J):
        hits = _hits(ids_ptr, key_ptr, start, last, own_id, own_key[:, None] + 1, lower, upper, hits, BOUNDS,
                     BLOCK_J)
    return tl.max(hits.to(tl.int32), axis=1)


@deferrable
@triton.jit(do_not_specialize=["T", "B", "STEPS"])  # counts: see _common.autotune
def _m3_select_kernel(ids_ptr,  # [T] int32/int64 token ids
                      key_ptr,  # [T] int32 order keys (_m3_keys_kernel)
                      cu_ptr,  # [B + 1] int32/int64 sequence offsets
                      y_ptr,  # [T] float32 out
                      T, B, STEPS,
                      BLOCK_T: tl.constexpr, BLOCK_J: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_sync(USE_PDL)  # the keys are the previous kernel's
    tile = tl.program_id(0) * BLOCK_T
    start = tl.maximum(tile, _offset(cu_ptr, 0, T))
    end = tl.minimum(tile + BLOCK_T, _offset(cu_ptr, B, T))
    rows = tile + tl.arange(0, BLOCK_T)
    real = (rows >= start) & (rows < end)
    own_id = tl.load(ids_ptr + rows, mask=real, other=0)
    own_key = tl.load(key_ptr + rows, mask=real, other=-1)
    # the tokens to compare with: those of the sequences from the first real row's to the last one's, [first, last);
    # none for a tile of filler rows
    seq_first = _sequence(cu_ptr, start, B, T, STEPS)
    seq_last = _sequence(cu_ptr, end - 1, B, T, STEPS)
    first = _offset(cu_ptr, seq_first, T)
    last = tl.where(start < end, _offset(cu_ptr, tl.minimum(seq_last + 1, B), T), first)
    if seq_first == seq_last:  # one sequence: [first, last) is every real row's own
        outranked = _outranked(ids_ptr, key_ptr, rows, own_id, own_key, first, last, first, last, tile, False,
                               BLOCK_T, BLOCK_J)
    else:  # each row's own sequence [lower, upper)
        seq = _sequence(cu_ptr, rows, B, T, STEPS)
        lower = _offset(cu_ptr, seq, T)
        upper = _offset(cu_ptr, tl.minimum(seq + 1, B), T)
        outranked = _outranked(ids_ptr, key_ptr, rows, own_id, own_key, lower, upper, first, last, tile, True,
                               BLOCK_T, BLOCK_J)
    kept = real & (outranked == 0) & (own_key >= 0)
    tl.store(y_ptr + rows, tl.where(kept, own_key.to(tl.float32, bitcast=True), 0.0), mask=rows < T)


def _check(x: Tensor, weight: Tensor, bias: Tensor, ids: Tensor, cu_seqlens: Tensor, dropped: Tensor,
           out: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The offsets, ids and dropped ids contiguous, and the [T] float32 output (fresh, or the caller's `out`)."""
    check_device("m3_sparse", x, weight, bias)
    cu_seqlens = offsets("m3_sparse", x, cu_seqlens)
    if x.dtype not in DTYPES or weight.dtype != x.dtype or bias.dtype != torch.float32:
        raise TypeError(f"m3_sparse: x and weight must share one of {DTYPES} and bias be float32, got {x.dtype}, "
                        f"{weight.dtype}, {bias.dtype}")
    tokens, hidden = x.shape
    if weight.shape != (hidden,) or bias.shape != (1,):
        raise ValueError(f"m3_sparse: x {tuple(x.shape)}, weight {tuple(weight.shape)} and bias {tuple(bias.shape)} "
                         "do not fit x @ weight + bias with x [T, H], weight [H] and bias [1]")
    for name, t, shape in (("ids", ids, (tokens,)), ("dropped", dropped, None)):
        if (t.dtype not in ID_DTYPES or t.device != x.device or t.dim() != 1
                or (shape is not None and t.shape != shape)):
            raise ValueError(f"m3_sparse: {name} must be a {'[T]' if shape else '[K]'} int32/int64 vector on "
                             f"{x.device}, got {tuple(t.shape)} {t.dtype} on {t.device}")
    if out is None:
        out = torch.empty(tokens, dtype=torch.float32, device=x.device)
    elif out.shape != (tokens,) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"m3_sparse: out must be a contiguous torch.float32 tensor of shape ({tokens},)")
    return cu_seqlens, ids.contiguous(), dropped.contiguous(), out


def m3_sparse(x: Tensor, weight: Tensor, bias: Tensor, ids: Tensor, cu_seqlens: Tensor, dropped: Tensor, *,
              out: Tensor | None = None) -> Tensor:
    """out[t] = relu(x[t] . weight + bias) where token t is its (sequence, id) group's representative (the largest
    weight, NaN above every number, the lowest index among equals) and ids[t] is not in `dropped`, else 0: x [T, H]
    (fp32/fp16/bf16, any strides), weight [H] in x's dtype, bias [1] float32, ids [T] and dropped [K] int32/int64,
    non-decreasing offsets cu_seqlens [B + 1] on x's device -> [T] float32 (tokens outside [cu_seqlens[0],
    cu_seqlens[B]) give 0 and are never read; offsets are clamped to [0, T]). `out` (contiguous [T] float32) is
    written in place."""
    cu_seqlens, ids, dropped, y = _check(x, weight, bias, ids, cu_seqlens, dropped, out)
    tokens, hidden = x.shape
    if tokens:
        segments = cu_seqlens.numel() - 1
        keys = torch.empty(tokens, dtype=torch.int32, device=x.device)
        block_h = min(triton.next_power_of_2(hidden), 256)
        block_t = max(16, min(128, 8192 // block_h))
        _m3_keys_kernel[(triton.cdiv(tokens, block_t),)](
            x, weight, bias, ids, cu_seqlens, dropped, keys, tokens, hidden, segments, dropped.numel(), x.stride(0),
            x.stride(1), weight.stride(0), BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4, **pdl_args(x))
        _m3_select_kernel[(triton.cdiv(tokens, SELECT_ROWS),)](
            ids, keys, cu_seqlens, y, tokens, segments, max(segments, 1).bit_length(), BLOCK_T=SELECT_ROWS,
            BLOCK_J=BLOCK_J, num_warps=SELECT_WARPS, **pdl_args(x))
    return y
