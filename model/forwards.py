"""The forward paths of one model on its device, each on its KernelPath's current selection (model.kernel_path).

Layouts: "packed" (serving) runs the real tokens of the batch back to back, no padding (model.packing.Packed);
"padded" pads every row to the longest, the classic layout, kept as the tests' oracle. On a CUDA device the packed
forward is replayed from CUDA graphs per shape bucket (model.graphs) unless graphs are off; batches outside the
buckets, reference re-runs and timed batches run eagerly."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from fusedserve import kernels
from fusedserve.kernels.timing import OpTimer
from fusedserve.model.api import Rows
from fusedserve.model.kernel_path import KernelPath
from fusedserve.model.packing import Packed


class Pending:
    """A forward in flight: `wait()` blocks until its result is on the host and returns it."""

    __slots__ = ("_result", "_done")

    def __init__(self, result: Tensor, done: torch.cuda.Event | None = None) -> None:
        self._result, self._done = result, done

    def ready(self) -> bool:
        return self._done is None or self._done.query()

    def wait(self) -> Tensor:
        if self._done is not None:
            self._done.synchronize()
        return self._result


class Forwards:
    """`encoder` then `head` (pooling, a classifier's or SPLADE's: its output rows are `head.dim` wide), eagerly or
    from CUDA graphs. pair_types: text pairs carry token types (the second text's: 1)."""

    def __init__(self, encoder: torch.nn.Module, head: torch.nn.Module, kernel_path: KernelPath, *,
                 pair_types: bool = False, cuda_graphs: bool = True, max_batch_tokens: int,
                 max_batch: int, max_graphs: int = 256) -> None:
        self.encoder, self.head, self.kernel_path = encoder, head, kernel_path
        self.config, self.dim = encoder.config, head.dim
        self.device, self.layout = kernel_path.device, kernel_path.layout
        self.token_layout = dict(pad_token_id=self.config.pad_token_id, position_offset=self.config.position_offset,
                                 pair_types=pair_types)
        self._observer: kernels.Observer | None = None  # set inside timed()
        self.graphs = None
        if cuda_graphs and self.layout == "packed" and self.device.type == "cuda":
            from fusedserve.model.graphs import CudaGraphs

            self.graphs = CudaGraphs(encoder, self.device, max_tokens=max_batch_tokens, max_batch=max_batch,
                                     max_graphs=max_graphs, head=head, attention=kernel_path.attention,
                                     **self.token_layout)

    @torch.inference_mode()
    def launch_ids(self, batch: Rows | list[list[int]], *, graphs: bool = True) -> Pending:
        """Start the forward of `batch` and return at once where the CUDA-graph path can (the replay and the copy
        of its result to pinned host memory are queued on the stream); `Pending.wait()` gives the unnormalized
        pooled embeddings [len(batch), dim], float32 on the CPU. The eager paths (no bucket fits, inside
        timed()) compute before returning. The server's worker launches its next batch before it waits for this
        one (server.batcher)."""
        batch = batch if isinstance(batch, Rows) else Rows.of(batch)
        if not len(batch):
            return Pending(torch.empty(0, self.dim))
        with kernels.use(self.kernel_path.selection, self._observer):
            if self.graphs is not None and graphs and self._observer is None:
                pooled = self.graphs.run(batch)  # a view of the graph's output: valid until the bucket's next replay
                if pooled is not None:
                    host = torch.empty(pooled.shape, dtype=pooled.dtype, pin_memory=True)
                    host.copy_(pooled, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record()
                    return Pending(host, done)
            return Pending(self.forward_eager(batch).cpu())

    @torch.inference_mode()
    def on_reference(self, batch: Rows) -> Tensor:
        """`batch`'s unnormalized output rows, eagerly on the torch reference (the worker's re-run of a batch whose
        fused forward failed); the path stays as it is."""
        if not len(batch):
            return torch.empty(0, self.dim)
        with kernels.use(self.kernel_path.reference):
            return self.forward_eager(batch).cpu()

    @torch.inference_mode()
    def embed_tokens(self, batch: Rows | list[list[int]]) -> Tensor:
        """Per-token hidden states of every row, back to back ([tokens, hidden] float32 on the CPU, special tokens
        included; row i is the next batch.lengths[i] of them): the encoder's packed forward on the current
        selection, eagerly (no graph bucket has per-token output)."""
        batch = batch if isinstance(batch, Rows) else Rows.of(batch)
        return self.token_states(batch, lambda hidden, packed: hidden.float()).cpu()

    def token_states(self, batch: Rows, then: Callable[[Tensor, Packed], Tensor]) -> Tensor:
        """then(hidden, packed) on the per-token states ([batch.tokens, hidden] on the device, in the encoder's dtype)
        of the packed forward, eagerly, on the current selection (then's kernels too)."""
        with kernels.use(self.kernel_path.selection):
            packed = Packed.from_rows(batch, self.device, **self.token_layout)
            return then(self.encoder.forward_packed(packed, self.kernel_path.attention)[: batch.tokens], packed)

    def masked_states(self, batch: Rows, attended) -> Tensor:
        """Per-token states ([batch.tokens, hidden] on the device, in the encoder's dtype, rows back to back) where row
        i's keys are its first attended[i] tokens: its other tokens are computed as queries but attended to by none
        (a ColBERT query's expansion tokens under PyLate's attention mask). The packed layout attends every token of
        a sequence, so this runs the padded one, eagerly, on the current selection."""
        with kernels.use(self.kernel_path.selection):
            seq = batch.longest
            input_ids = torch.full((len(batch), seq), self.config.pad_token_id, dtype=torch.long)
            keys = torch.zeros((len(batch), seq), dtype=torch.bool)
            real = torch.zeros((len(batch), seq), dtype=torch.bool)
            for row, ids in enumerate(batch.tolist()):
                input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                keys[row, : int(attended[row])] = True
                real[row, : len(ids)] = True
            hidden = self.encoder(input_ids.to(self.device), keys.to(self.device), None)
            return hidden[real.to(self.device)]

    def forward_eager(self, rows: Rows) -> Tensor:
        """The output rows of `rows` on the device, in whatever kernels.use() is current (the callers set it)."""
        if self.layout == "packed":
            packed = Packed.from_rows(rows, self.device, **self.token_layout)
            return self.head(self.encoder.forward_packed(packed, self.kernel_path.attention), packed)
        batch = rows.tolist()  # the padded layout: the tests' oracle
        seq = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), seq), self.config.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), seq), dtype=torch.bool)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[row, : len(ids)] = True
        types = None
        if self.token_layout["pair_types"]:  # the packed layout's token types, padded
            flat, _, _ = Packed.host_buffers(rows, rows.tokens, len(rows), seq, **self.token_layout)
            types = torch.zeros_like(input_ids)
            types[mask] = flat[Packed.FIELDS.index("token_type_ids")]
            types = types.to(self.device)
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        return self.head.forward_padded(self.encoder(input_ids, mask, types), mask)

    @torch.inference_mode()
    def compile_ahead(self, batches: list[list[list[int]]]) -> None:
        """Compile the Triton kernels the eager forwards of `batches` launch, side by side, without running them
        (kernels.compile_only; their outputs are thrown away): the same forwards run next find them compiled."""
        with kernels.use(self.kernel_path.selection), kernels.compile_only():
            for batch in batches:
                self.forward_eager(Rows.of(batch))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- kernel-timed forwards: eager, every op call timed --------------------------------------------------------
    @contextlib.contextmanager
    def timed(self, callback: Callable[[str, str, float], None]) -> Iterator[None]:
        """Forwards inside the block run eagerly with every op call timed (device events on a GPU, read once after
        the block); callback(op, backend, seconds) gets each call's time, labelled with the backend that ran it."""
        timer = OpTimer(self.device)
        self._observer = timer.call
        try:
            yield
        finally:
            self._observer = None
        for op, backend, seconds in timer.results():
            callback(op, backend, seconds)

    def timed_steps(self, batch: Rows | list[list[int]], callback: Callable[[str, str, float], None]) -> Iterator[None]:
        """`batch`'s eager forward as in timed(), one block per step (the embeddings, each layer, the head: packed
        layout; the whole forward in one step otherwise), each step inside the selection and timer, none across a
        yield: the server's worker answers the batches that arrive between two steps on their usual path, so they
        wait for one block's launches at most. callback gets every call's time after the last step. A new
        selection installed between two steps (a backend switch, a fallback) ends the forward there, unreported:
        the path it timed is no longer the one served."""
        timer = OpTimer(self.device)
        selection, attention = self.kernel_path.selection, self.kernel_path.attention
        batch = batch if isinstance(batch, Rows) else Rows.of(batch)

        @contextlib.contextmanager
        def step() -> Iterator[None]:
            with torch.inference_mode(), kernels.use(selection, timer.call):
                yield

        if self.layout != "packed":
            with step():
                self.forward_eager(batch)
        else:
            with step():
                packed = Packed.from_rows(batch, self.device, **self.token_layout)
                blocks = self.encoder.packed_steps(packed, attention)
            while True:
                with step():
                    hidden = next(blocks, None)
                    if hidden is None:
                        break
                    last = hidden
                yield
                if self.kernel_path.selection is not selection:
                    return
            with step():
                self.head(last, packed)
        for op, backend, seconds in timer.results():
            callback(op, backend, seconds)

    # ---- CUDA graphs captured ahead of the batches that need them -------------------------------------------------
    def capture_graphs(self, progress: Callable[[int, int], None] | None = None, limit: int | None = None) -> int:
        """Capture the reachable CUDA-graph buckets not held yet (model.graphs.CudaGraphs.capture_all), the first
        `limit` in order of need where given, on the current selection; returns how many were captured (0 without
        graphs)."""
        if self.graphs is None:
            return 0
        with kernels.use(self.kernel_path.selection):
            return self.graphs.capture_all(progress, limit)

    def capture_next_graph(self) -> bool:
        """Capture the next reachable bucket not held yet; False when there is none (or no graphs)."""
        if self.graphs is None:
            return False
        with kernels.use(self.kernel_path.selection):
            return self.graphs.capture_next()

    @property
    def graphs_pending(self) -> int:
        """Reachable CUDA-graph buckets not captured yet."""
        return len(self.graphs.pending()) if self.graphs is not None else 0
