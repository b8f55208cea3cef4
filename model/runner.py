"""Turns texts or token ids into pooled embeddings: tokenize, pack (or pad) the batch, forward, pool.
Device, dtype, layout, CUDA graphs and the kernel backend choice are decided here, once, at load.

Layouts: "packed" (default) runs the real tokens of the batch back to back, no padding (model.encoder.Packed);
"padded" pads every row to the longest, the classic layout, kept for comparison. On a CUDA device the packed
forward is replayed from CUDA graphs per shape bucket (model.graphs) unless graphs are off; batches outside the
buckets, and batches on the reference path or under the kernel timer, run eagerly."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

import kernels
from model.config import PRESETS, EncoderConfig
from model.encoder import (FEW_TOKEN_OPS, FUSED_LAYER_TOKENS, Encoder, Packed, kernel_ops, mean_pool, packed_mean_pool,
                           resolve_attention)
from model.tokenizer import TextTokenizer
from model.weights import CheckpointError, default_model_dir, load_encoder

log = logging.getLogger("fusedserve.model")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available here")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {dtype!r}") from None


@dataclass(frozen=True)
class LoadReport:
    model: str
    device: torch.device
    dtype: torch.dtype
    config: EncoderConfig
    kernels: kernels.Selection
    seconds: float

    def __str__(self) -> str:
        c = self.config
        return (
            f"model {self.model}: {c.num_layers} layers, hidden {c.hidden_size}, heads {c.num_heads}, "
            f"max_seq_length {c.max_seq_length}\n"
            f"device {self.device}, dtype {str(self.dtype).removeprefix('torch.')}, loaded in {self.seconds:.1f}s\n"
            f"{self.kernels.report()}"
        )


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


class Embedder:
    """Owns one encoder on one device. Not thread-safe: one worker calls it (the server's batcher)."""

    def __init__(self, encoder: Encoder, tokenizer: TextTokenizer, name: str,
                 device: torch.device, dtype: torch.dtype, *, layout: str = "packed", attention: str = "auto",
                 cuda_graphs: bool = True, max_batch_tokens: int = 8192, max_batch: int = 256,
                 max_graphs: int = 256) -> None:
        if layout not in ("packed", "padded"):
            raise ValueError(f"layout must be packed or padded, got {layout!r}")
        self.encoder = encoder.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.config = encoder.config
        self.tokenizer = tokenizer
        self.name, self.device, self.dtype = name, device, dtype
        self.layout = layout
        # packed batches only: auto = the few-token layer + varlen flash attention in fp16/bf16 on CUDA (varlen alone
        # if the few-token ops land on the reference: configure_kernels), pad-for-SDPA otherwise
        self.requested_attention = attention if layout == "packed" else "pad"
        self.attention = resolve_attention(self.requested_attention, device, dtype)
        self.attention_reason = self._attention_reason(self.attention)
        self.graphs = None
        if cuda_graphs and layout == "packed" and device.type == "cuda":
            from model.graphs import CudaGraphs

            self.graphs = CudaGraphs(self.encoder, device, max_tokens=max_batch_tokens, max_batch=max_batch,
                                     max_graphs=max_graphs, pad_token_id=self.config.pad_token_id,
                                     attention=self.attention)

    @classmethod
    def load(
        cls,
        model: str = "default",
        *,
        device: str = "auto",
        dtype: str = "auto",
        fused: bool = True,
        backend: str = "auto",
        backend_overrides: dict[str, str] | None = None,
        max_seq_length: int | None = None,
        **options,
    ) -> tuple[Embedder, LoadReport]:
        """model: "default" (the packaged all-MiniLM-L6-v2), a preset name (random init, default tokenizer),
        or a checkpoint directory. options: layout, attention, cuda_graphs, max_batch_tokens, max_batch,
        max_graphs (see __init__)."""
        started = time.perf_counter()
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        if model in PRESETS:
            config = EncoderConfig.from_name(model)
            encoder, tokenizer_dir, name = Encoder(config), default_model_dir(), f"{model} (random init)"
        else:
            path = default_model_dir() if model == "default" else Path(model)
            encoder, tokenizer_dir = load_encoder(path), path
            name = "all-MiniLM-L6-v2" if model == "default" else path.name
        if max_seq_length is not None:
            encoder.config = encoder.config.replace(max_seq_length=max_seq_length)
        if not (tokenizer_dir / "tokenizer.json").is_file():
            raise CheckpointError(f"{tokenizer_dir} has no tokenizer.json")
        tokenizer = TextTokenizer(tokenizer_dir, encoder.config.max_seq_length)
        embedder = cls(encoder, tokenizer, name, dev, dt, **options)
        selection = embedder.configure_kernels(backend=backend, overrides=backend_overrides, fused=fused)
        return embedder, LoadReport(name, dev, dt, embedder.config, selection, time.perf_counter() - started)

    def configure_kernels(self, *, backend: str = "auto", overrides: dict[str, str] | None = None,
                          fused: bool = True) -> kernels.Selection:
        """Choose the kernel backend per op (kernels.configure) for the ops this model's forward calls, at its
        device, dtype and width. Under CUDA graphs only the kernels' device time counts in the race; launched
        eagerly, host cost counts too. Called at load and by the server's fused-path switch.
        With auto attention on a GPU the few-token layer is used only while its ops run on a fused backend: if any
        lands on the reference (fused path off, Triton missing or failing its self-test, backend=cuda), attention
        is varlen until the next call here finds them fused again."""
        def configure(ops) -> kernels.Selection:
            return kernels.configure(self.device, (self.dtype,), backend=backend, overrides=overrides, fused=fused,
                                     hidden_sizes=(self.config.hidden_size,),
                                     race_timing="device" if self.graphs is not None else "eager", ops=ops)

        attention = resolve_attention(self.requested_attention, self.device, self.dtype)
        reason = self._attention_reason(attention)
        if self.requested_attention == "auto" and attention == "fused":
            # the few-token ops first, alone (Triton-only: no race; their self-test verdicts are cached for the
            # configure below), so a fallback to varlen does not race the other ops twice
            probe = configure(FEW_TOKEN_OPS)
            on_reference = [op for op in FEW_TOKEN_OPS if probe.backend_of(op) == kernels.registry.REFERENCE_BACKEND]
            if on_reference:
                attention, reason = "varlen", (f"auto: varlen, since the few-token layer's {', '.join(on_reference)} "
                                               f"would run on the reference (slower than varlen)")
        selection = configure(kernel_ops(self.layout, attention, self.device, self.dtype))
        self.attention, self.attention_reason = attention, reason
        if self.graphs is not None:
            self.graphs.attention = attention  # part of the graphs' fingerprint: a change drops them
        log.info("attention %s (%s)", attention, reason)
        return selection

    def _attention_reason(self, attention: str) -> str:
        if self.requested_attention != "auto":
            return "as configured" if self.layout == "packed" else "padded layout"
        if attention == "fused":
            return f"auto: the few-token layer for batches of <= {FUSED_LAYER_TOKENS} tokens, varlen above"
        return "auto: varlen attention needs fp16/bf16 on CUDA"

    @torch.inference_mode()
    def embed_ids(self, batch: list[list[int]], normalize: bool | None = None, *, graphs: bool = True) -> Tensor:
        """Pooled embeddings [len(batch), hidden] (float32, on the CPU) for token-id rows of any lengths.
        graphs=False forces the eager path (the kernel timer needs per-op launches)."""
        pooled = self.launch_ids(batch, graphs=graphs).wait()
        normalize = self.config.normalize if normalize is None else normalize
        return torch.nn.functional.normalize(pooled, p=2, dim=1) if normalize else pooled

    @torch.inference_mode()
    def launch_ids(self, batch: list[list[int]], *, graphs: bool = True) -> Pending:
        """Start the forward of `batch` and return at once where the CUDA-graph path can (the replay and the copy
        of its result to pinned host memory are queued on the stream); `Pending.wait()` gives the unnormalized
        pooled embeddings [len(batch), hidden], float32 on the CPU. The eager paths compute before returning.
        The server's worker launches its next batch before it waits for this one (server.batcher)."""
        if not batch:
            return Pending(torch.empty(0, self.config.hidden_size))
        if self.graphs is not None and graphs and not kernels.on_reference_path():
            pooled = self.graphs.run(batch)  # a view of the graph's output: valid until the bucket's next replay
            if pooled is not None:
                host = torch.empty(pooled.shape, dtype=pooled.dtype, pin_memory=True)
                host.copy_(pooled, non_blocking=True)
                done = torch.cuda.Event()
                done.record()
                return Pending(host, done)
        return Pending(self._forward_eager(batch).cpu())

    def _forward_eager(self, batch: list[list[int]]) -> Tensor:
        if self.layout == "packed":
            packed = Packed.from_rows(batch, self.device, pad_token_id=self.config.pad_token_id)
            return packed_mean_pool(self.encoder.forward_packed(packed, self.attention), packed, normalize=False)
        seq = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), seq), self.config.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), seq), dtype=torch.bool)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[row, : len(ids)] = True
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        return mean_pool(self.encoder(input_ids, mask), mask, normalize=False)

    def embed(self, texts: list[str], normalize: bool | None = None, truncate: bool = True) -> Tensor:
        return self.embed_ids(self.tokenizer.encode(texts, truncate=truncate), normalize)
