"""CUDA graphs of the packed forward + the model's head (pooling, or a classifier), one per shape bucket, so a batch costs one graph replay
instead of ~10 kernel launches per layer from Python.

A bucket is (tokens, batch, seq, dense): the packed token count rounded up to token_buckets() (quarter-power-of-two
steps, eighth steps above 1024 tokens); filler tokens and sequences go to scratch rows (see model.packing.Packed).
With varlen attention (fp16/bf16 on CUDA, the default; "fused" attention buckets the same way) the row count is
rounded up to a power of 4 and seq is min(model's longest, tokens): the longest row only bounds the attention grid,
so a bucket is really (tokens, batch) and every reachable one can be captured ahead of traffic (`capture_all` for
the first few before ready, `capture_next` for the rest after, while the model is idle, the buckets traffic has
already asked for first; one that batches keep missing is captured on the spot). With pad attention the row
count goes to a power of two and the longest row to SEQ_BUCKETS (the padded block is batch x seq): too many to
capture ahead, so those are captured on first use. `dense` marks a batch that fills its bucket exactly (equal-length
rows, e.g. one input truncated at the model's limit): its graph runs attention without a mask and without the
scatter/gather (with varlen attention these are captured at start-up too). At most `max_graphs` are held (least
recently used evicted). All graphs share one memory pool: they never run concurrently (one worker owns the model) and each
graph's only live outputs are its static buffers, so the pool costs about as much as the largest graph's
activations; `stats()` reports it.

The kernels a graph replays are the ones of the selection it was captured under: the kernel path
(model.kernel_path.KernelPath) sets the fingerprint (selection version, attention, precision) whenever it installs a
selection, and a new one drops every graph. Kernel-timed batches never reach here: they run eagerly
(model.forwards.Forwards.timed).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fusedserve.model.api import Rows
from fusedserve.model.packing import OFFSET_ATTENTIONS, Packed, packed_mean_pool

log = logging.getLogger("fusedserve.model")

SEQ_BUCKETS = (16, 32, 64, 128, 256, 512)


# While captures are deferred (the owner captures ahead, when idle), a batch whose bucket is missing runs eagerly;
# the bucket of one that has come this many times is captured on the spot. Under traffic that never leaves the model
# idle the buckets it needs would otherwise wait for the deferral to end, every batch of theirs eager meanwhile (an
# eager batch of ~100 inputs costs several times its replay; one capture, a few eager batches).
CAPTURE_AFTER_MISSES = 4
FINE_BUCKETS_FROM = 1024  # token counts above this get eighth-power-of-two steps


def token_buckets(limit: int) -> list[int]:
    """16, 32, 48, 64, then four steps per power of two (x1.25, 1.5, 1.75, 2: at most 25% filler) up to
    FINE_BUCKETS_FROM, eight steps per power of two above it (at most 12.5% filler): small batches are latency-bound,
    so their filler is nearly free, while above ~1k tokens the forward's time grows with the token count."""
    out = [16, 32, 48, 64]
    p = 64
    while out[-1] < limit:
        steps = 8 if p >= FINE_BUCKETS_FROM else 4
        out += [p + p * i // steps for i in range(1, steps + 1)]
        p *= 2
    return [t for t in out if t < limit] + [next(t for t in out if t >= limit)]


def _ceil_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    host: Tensor      # pinned int64, a batch's whole input (_views): one H2D copy a batch
    device: Tensor    # the same on the device (the graph's static input)
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray]  # numpy views of `host` (_views), what Packed.fill writes
    packed: Packed    # views of `device`: every tensor the graph reads outlives it here
    pooled: Tensor    # [batch, hidden] float32, the graph's static output
    copied: torch.cuda.Event  # the last H2D copy out of `host`: it must finish before `host` is refilled


def _buffer_size(tokens: int, batch: int) -> int:
    """int64 elements of a bucket's input buffer (_views): the fields, the lengths, then batch + 1 int32."""
    return _offsets_at(tokens, batch) + (batch + 2) // 2


def _offsets_at(tokens: int, batch: int) -> int:
    # cu_seqlens starts 16-byte aligned, as a tensor of its own would: Triton specializes a kernel on its pointer
    # arguments' 16-byte alignment, and the eager forwards (and the shape sweep) pass offsets allocated apart
    return len(Packed.FIELDS) * tokens + batch + batch % 2


def _views(buffer: Tensor, tokens: int, batch: int) -> tuple[Tensor, Tensor, Tensor]:
    """A bucket's one input buffer as Packed.fill's [6, tokens] fields and [batch] lengths, then the
    [batch + 1] int32 cu_seqlens in its tail: made once per graph, so a batch is one fill and one copy."""
    rows = len(Packed.FIELDS)
    flat = buffer[: rows * tokens].view(rows, tokens)
    lengths = buffer[rows * tokens: rows * tokens + batch]
    return flat, lengths, buffer[_offsets_at(tokens, batch):].view(torch.int32)[: batch + 1]


def _ceil_pow4(n: int) -> int:
    p = 1
    while p < n:
        p *= 4
    return p


class CudaGraphs:
    def __init__(self, encoder: torch.nn.Module, device: torch.device, *, max_tokens: int, max_batch: int,
                 max_graphs: int = 256, head: Callable[[Tensor, Packed], Tensor] | None = None, pad_token_id: int = 0,
                 position_offset: int = 0, pair_types: bool = False, attention: str = "pad") -> None:
        """head: hidden states [T, H] and the batch -> the output rows [batch, dim] (default: mean pooling)."""
        self.encoder, self.device, self.attention = encoder, device, attention
        self.head = head or (lambda hidden, p: packed_mean_pool(hidden, p, normalize=False))
        self.position_offset, self.pair_types = position_offset, pair_types
        self.tokens = token_buckets(max_tokens)
        self.max_batch = _ceil_pow2(max_batch)
        # the longest input the service lets through (inputs are truncated to max_seq_length)
        longest = min(encoder.config.max_seq_length, SEQ_BUCKETS[-1])
        self.max_seq = next(s for s in SEQ_BUCKETS if s >= longest)
        self.max_graphs, self.pad_token_id = max_graphs, pad_token_id
        self.pool = None  # created at the first capture (so the bucket arithmetic works without a GPU)
        self.graphs: OrderedDict[tuple[int, int, int, bool], _Graph] = OrderedDict()
        self.fingerprint: tuple | None = None
        # a batch whose bucket is not held is captured on the spot, except until this time.monotonic() deadline,
        # while the owner captures them ahead of traffic (it runs eagerly then: a request does not wait for a capture)
        self.defer_captures_until = 0.0
        self.missed: Counter[tuple[int, int, int, bool]] = Counter()  # deferred buckets' eager batches, per bucket
        self.captures = self.evictions = self.eager_fallbacks = self.replays = 0
        self.capture_seconds = 0.0
        self.pool_bytes = 0  # growth of reserved device memory while capturing: what the graphs hold

    def _batch_bucket(self, rows: int) -> int:
        # varlen: rows only size the attention grid and the pooled output, so powers of 4 (fewer graphs);
        # pad attention: the padded block is batch x seq, so powers of 2
        return min(_ceil_pow4(rows) if self.attention in OFFSET_ATTENTIONS else _ceil_pow2(rows), self.max_batch)

    def bucket(self, rows: Rows | list[list[int]]) -> tuple[int, int, int, bool] | None:
        """The (tokens, batch, seq, dense) key of the graph that runs `rows`, or None when none can."""
        rows = rows if isinstance(rows, Rows) else Rows.of(rows)
        tokens, longest = rows.tokens, rows.longest
        if tokens > self.tokens[-1] or longest > self.max_seq or len(rows) > self.max_batch:
            return None
        t = self.tokens[bisect.bisect_left(self.tokens, tokens)]
        s = SEQ_BUCKETS[bisect.bisect_left(SEQ_BUCKETS, longest)]
        if tokens == t == _ceil_pow2(len(rows)) * s:  # equal-length rows filling the bucket: the dense graph
            return t, _ceil_pow2(len(rows)), s, True
        if self.attention in OFFSET_ATTENTIONS:  # the longest row only bounds the attention grid: no row passes t
            return t, self._batch_bucket(len(rows)), min(self.max_seq, t), False
        return t, self._batch_bucket(len(rows)), s, False

    def reachable_keys(self) -> list[tuple[int, int, int, bool]]:
        """Every varlen bucket some batch can land in: token bucket t (counts in (t_prev, t]) and batch bucket b
        (rows in (b_prev, b]) with rows <= tokens <= rows x max_seq possible, then the dense ones (b rows of
        exactly s tokens, s a SEQ_BUCKETS length no longer than the model takes: a single 256-token truncated
        input is one). Empty for pad attention, whose keys also carry the longest row (too many to capture ahead)."""
        if self.attention not in OFFSET_ATTENTIONS:
            return []
        batches = sorted({self._batch_bucket(n) for n in range(1, self.max_batch + 1)})
        keys = []
        for t_prev, t in zip([0, *self.tokens], self.tokens):
            for b_prev, b in zip([0, *batches], batches):
                if b_prev + 1 <= t and t_prev + 1 <= b * self.max_seq:
                    keys.append((t, b, min(self.max_seq, t), False))
        tokens = set(self.tokens)
        for s in (s for s in SEQ_BUCKETS if s <= self.encoder.config.max_seq_length):
            b = 1
            while b <= self.max_batch and b * s in tokens:
                keys.append((b * s, b, s, True))
                b *= 2
        return keys

    def pending(self) -> list[tuple[int, int, int, bool]]:
        """The reachable buckets not captured yet, as many as max_graphs leaves room for, in order of need: those
        traffic has missed (most missed first), then single requests (batch bucket 1, shortest first), then ever
        larger batches."""
        keys = sorted((k for k in self.reachable_keys() if k not in self.graphs),
                      key=lambda k: (-self.missed[k], k[1], k[0], k[3]))
        return keys[: max(self.max_graphs - len(self.graphs), 0)]

    def capture_all(self, progress: Callable[[int, int], None] | None = None, limit: int | None = None) -> int:
        """Capture the pending buckets now (the first `limit` of them where given), so traffic never waits for a
        capture: a capture runs the forward twice first, and a first-seen row count autotunes the Triton kernels
        and sweeps the CUDA launch configs. Returns the number captured."""
        keys = self.pending()[:limit]
        for i, key in enumerate(keys):
            self._capture(key)
            if progress is not None:
                progress(i + 1, len(keys))
        return len(keys)

    def capture_next(self) -> bool:
        """Capture the first pending bucket; False when none is left (the service's captures after ready, one at a
        time while the model is idle)."""
        keys = self.pending()
        if keys:
            self._capture(keys[0])
        return bool(keys)

    def run(self, rows: Rows | list[list[int]]) -> Tensor | None:
        """The head's output [len(rows), dim] float32 on the device (unnormalized), or None when the batch
        is outside every bucket (the caller runs it eagerly)."""
        rows = rows if isinstance(rows, Rows) else Rows.of(rows)
        key = self.bucket(rows)
        if key is None:
            self.eager_fallbacks += 1
            return None
        entry = self.graphs.get(key)
        if entry is None:
            if time.monotonic() < self.defer_captures_until:  # captured ahead: this batch runs eagerly meanwhile
                self.missed[key] += 1
                if self.missed[key] < CAPTURE_AFTER_MISSES:
                    self.eager_fallbacks += 1
                    return None
            entry = self._capture(key)
        self.graphs.move_to_end(key)
        tokens, batch, seq, _ = key
        entry.copied.synchronize()  # a caller that did not wait for the last result must not race its copy
        flat, lengths, cu_seqlens = entry.arrays
        Packed.fill(rows, flat, lengths, seq, self.pad_token_id, cu_seqlens=cu_seqlens,
                    position_offset=self.position_offset, pair_types=self.pair_types)
        entry.device.copy_(entry.host, non_blocking=True)
        entry.copied.record()
        entry.graph.replay()
        self.replays += 1
        return entry.pooled[: len(rows)]

    def set_fingerprint(self, fingerprint: tuple) -> None:
        """What the graphs' kernels depend on (the owner's selection version and attention); a change drops them."""
        if fingerprint != self.fingerprint:
            if self.graphs:
                log.info("kernel selection or attention changed: dropping %d CUDA graphs", len(self.graphs))
                self._drop_all()
            self.fingerprint = fingerprint

    def _drop_all(self) -> None:
        """Drop every graph and their memory pool; self.pool is None exactly while no graph is held. The next
        capture takes a fresh pool: torch's allocator keeps a pool whose last graph is gone (use count 0) until its
        memory is released, and capturing into it again fails an internal assert in CUDACachingAllocator (after a
        fused-path toggle, once the collector has freed the dropped graphs)."""
        self.graphs.clear()
        self.pool = None
        self.pool_bytes = 0
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # hands the dropped pool's segments back (they are freeable only once empty)

    def _capture(self, key: tuple[int, int, int, bool]) -> _Graph:
        started = time.perf_counter()
        tokens, batch, seq, dense = key
        while len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)
            self.evictions += 1
            if not self.graphs:  # max_graphs=1: the pool lost its last graph
                self._drop_all()
        if self.pool is None:  # the first capture, or none held since the last drop: a pool no graph lives in
            self.pool = torch.cuda.graph_pool_handle()
        reserved = torch.cuda.memory_reserved(self.device)
        host = torch.empty(_buffer_size(tokens, batch), dtype=torch.long, pin_memory=True)
        arrays = tuple(view.numpy() for view in _views(host, tokens, batch))
        # until the first real fill: one filler token (valid indices, lengths >= 1)
        Packed.fill(Rows.of([[self.pad_token_id]]), arrays[0], arrays[1], seq, self.pad_token_id,
                    cu_seqlens=arrays[2], position_offset=self.position_offset)
        dev = host.to(self.device)
        flat, lengths, cu_seqlens = _views(dev, tokens, batch)
        packed = Packed.from_buffers(flat, lengths, seq, dense=dense, cu_seqlens=cu_seqlens)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # warm: lazy init, autotuning and launch-config sweeps happen outside capture
                self.head(self.encoder.forward_packed(packed, self.attention), packed)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's work on the device meanwhile (the verifier's reference forward) neither
        # invalidates the capture nor fails on it
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"), torch.inference_mode():
            pooled = self.head(self.encoder.forward_packed(packed, self.attention), packed)
        entry = _Graph(graph, host, dev, arrays, packed, pooled, torch.cuda.Event())
        self.graphs[key] = entry
        self.captures += 1
        self.capture_seconds += time.perf_counter() - started
        self.pool_bytes += max(torch.cuda.memory_reserved(self.device) - reserved, 0)
        log.info("captured CUDA graph tokens=%d batch=%d seq=%d%s in %.0f ms (%d held)", tokens, batch, seq,
                 " dense" if dense else "", (time.perf_counter() - started) * 1e3, len(self.graphs))
        return entry

    def stats(self) -> dict:
        return {
            "graphs": len(self.graphs), "max_graphs": self.max_graphs, "captures": self.captures,
            "evictions": self.evictions, "eager_fallbacks": self.eager_fallbacks,
            "capture_seconds": round(self.capture_seconds, 3),
            "replays": self.replays, "attention": self.attention,
            "pool_bytes": self.pool_bytes,
            "buckets": {"tokens": [self.tokens[0], self.tokens[-1]], "batch": self.max_batch, "seq": self.max_seq},
        }
