"""The serving core the routes share: model load and warm-up, the batcher and verifier, the embed path
(validate -> tokenize off the event loop -> enqueue -> await, watching for client disconnects) and the
runtime switches (fused path on/off, fallback). The model is a black box here: every kernel decision is the
Embedder's, asked for between batches on the batcher's thread."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
from starlette.requests import Request

from model.runner import Embedder, LoadReport
from model.tokenizer import InputTooLong
from server.batcher import Batcher
from server.config import Settings
from server.errors import BadRequest, PayloadTooLarge, Timeout, Unavailable, Unprocessable
from server.metrics import Metrics
from server.verify import Verifier

log = logging.getLogger("fusedserve")

DISCONNECT_POLL_S = 0.05
# Inputs this short are tokenized on the event loop (~50 us for a 20-word sentence): a hop to a worker thread and
# back costs ~250 us, a quarter of a single request's latency budget on a GPU. Longer inputs go to a thread (the
# tokenizer releases the GIL there; 16 texts of 1-200 words take ~1.6 ms).
INLINE_TOKENIZE_CHARS = 512


@dataclass
class EmbedResult:
    embeddings: np.ndarray  # [n, dim] float32
    tokens: int


class Service:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = Metrics()
        # set once each (loaded, then draining) and read from the event loop, the signal handler and the drain
        # timer: Events, so no reader depends on when another thread's write becomes visible
        self._ready = threading.Event()
        self._draining = threading.Event()
        self.embedder: Embedder | None = None
        self.report: LoadReport | None = None
        self.batcher: Batcher | None = None
        self.verifier: Verifier | None = None
        self.graph_warmup: tuple[int, float] | None = None  # (graphs captured at start-up, seconds)

    # ---- lifecycle --------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def mark_ready(self) -> None:
        self._ready.set()

    def start_draining(self) -> None:
        """Readiness and new requests answer 503 from now on (safe from a signal handler or a timer)."""
        self._draining.set()

    def load(self) -> None:
        s = self.settings
        if s.torch_threads:
            torch.set_num_threads(s.torch_threads)
        log.info("loading model %s on device %s (dtype %s) ...", s.model, s.device, s.dtype)
        self.embedder, self.report = Embedder.load(
            s.model, device=s.device, dtype=s.dtype, fused=s.fused, backend=s.backend,
            backend_overrides=dict(s.backend_overrides), max_seq_length=s.max_seq_length, attention=s.attention,
            cuda_graphs=s.cuda_graphs, max_batch_tokens=s.max_batch_tokens, max_batch=s.max_batch_requests,
            max_graphs=s.max_cuda_graphs)
        if s.verify_sample_rate > 0:
            self.verifier = Verifier(self.embedder.reference_copy(), s, self.metrics, self._on_mismatch)
            self.verifier.start()
        self.batcher = Batcher(self.embedder, s, self.metrics,
                               on_batch=self.verifier.submit if self.verifier else None)
        self.batcher.start()
        self._publish_backends()
        self.metrics.watch_device_memory(self.embedder.device)
        self.metrics.watch_cuda_graphs(self.embedder.graphs)

    def warm_up(self) -> None:
        """The model's warm-up batches (the largest shape, and a small one), so autotuning and allocation happen
        before ready, then the CUDA graphs."""
        s, e = self.settings, self.embedder
        started = time.perf_counter()
        for batch in e.warmup_batches():
            log.info("warm-up: batch of %d x %d tokens", len(batch), max(map(len, batch)))
            self.batcher.call_between_batches(lambda batch=batch: e.embed_ids(batch)).result()
        if e.graphs is not None and s.cuda_graph_warmup:
            self._capture_graphs()
        log.info("warm-up done in %.1fs", time.perf_counter() - started)

    def _capture_graphs(self) -> None:
        """Every reachable CUDA-graph bucket, on the worker thread, before ready: under traffic a capture would
        stall its batch for the capture (and the autotuning of a first-seen row count)."""
        started = time.perf_counter()

        def progress(done: int, todo: int) -> None:
            if done % max(todo // 10, 1) == 0 or done == todo:
                log.warning("capturing CUDA graphs: %d/%d (%.1fs)", done, todo, time.perf_counter() - started)

        captured = self.batcher.call_between_batches(lambda: self.embedder.capture_graphs(progress)).result()
        if captured:
            self.graph_warmup = (captured, time.perf_counter() - started)

    def startup_report(self) -> str:
        s = self.settings
        warmup = (f"\nCUDA graphs: {self.graph_warmup[0]} buckets captured at start-up in {self.graph_warmup[1]:.1f}s"
                  if self.graph_warmup is not None else "")
        return (f"{self.report}\n{self.embedder.report()}{warmup}\n"
                f"batching: max_batch_tokens {s.max_batch_tokens}, max_batch_requests "
                f"{s.max_batch_requests}, max_wait_ms {s.max_wait_ms:g}, max_queue {s.max_queue}; "
                f"verify_sample_rate {s.verify_sample_rate:g} ({s.verify_action}), "
                f"kernel_timing_sample_rate {s.kernel_timing_sample_rate:g}")

    def shutdown(self) -> None:
        self.start_draining()
        if self.batcher:
            drained = self.batcher.drain(timeout_s=self.settings.request_timeout_s)
            log.warning("batcher drained: %s", "all accepted requests answered" if drained else "timed out")
        if self.verifier:
            self.verifier.stop()

    @property
    def model_name(self) -> str:
        if self.settings.model_name:
            return self.settings.model_name
        return self.embedder.name if self.embedder else self.settings.model

    @property
    def dim(self) -> int:
        return self.embedder.config.hidden_size

    # ---- the embed path ---------------------------------------------------------------------------
    def check_ready(self) -> None:
        if self.draining:
            raise Unavailable("the server is shutting down", headers={"Retry-After": "1"})
        if not self.ready:
            raise Unavailable("the model is still loading", headers={"Retry-After": "5"})

    def check_count(self, n: int) -> None:
        if n == 0:
            raise BadRequest("no inputs given")
        if n > self.settings.max_client_batch:
            raise PayloadTooLarge(f"{n} inputs in one request; the limit is {self.settings.max_client_batch}")

    async def embed_texts(self, texts: list[str], *, normalize: bool, truncate: bool, request: Request) -> EmbedResult:
        self.check_ready()
        self.check_count(len(texts))
        for i, text in enumerate(texts):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # the HTTP routes' JSON parser already refuses lone surrogates ("\ud800");
                # a Python caller's strings can still hold them, and the tokenizer cannot take them
                raise Unprocessable(f"input {i} is not valid Unicode (lone surrogate)") from None
        try:
            if sum(map(len, texts)) <= INLINE_TOKENIZE_CHARS:
                ids = self.embedder.tokenizer.encode(texts, truncate)
            else:
                ids = await asyncio.to_thread(self.embedder.tokenizer.encode, texts, truncate)
        except InputTooLong as exc:
            raise PayloadTooLarge(str(exc)) from None
        return await self.embed_ids(ids, normalize=normalize, request=request)

    def validate_ids(self, rows: list[list[int]], truncate: bool) -> list[list[int]]:
        vocab, limit = self.embedder.config.vocab_size, self.embedder.config.max_seq_length
        out = []
        for i, row in enumerate(rows):
            if not row:
                raise Unprocessable(f"input {i} is an empty token list")
            if min(row) < 0 or max(row) >= vocab:  # min/max run in C; the offender is looked up only on failure
                bad = next(t for t in row if not 0 <= t < vocab)
                raise Unprocessable(f"input {i} has token id {bad} outside the vocabulary [0, {vocab})")
            if len(row) > limit:
                if not truncate:
                    raise PayloadTooLarge(f"input {i} has {len(row)} tokens, over the limit of {limit}")
                row = row[: limit - 1] + [row[-1]]
            out.append(row)
        return out

    async def embed_ids(self, ids: list[list[int]], *, normalize: bool, request: Request) -> EmbedResult:
        self.check_ready()
        self.check_count(len(ids))
        job = self.batcher.submit(ids, normalize, self.settings.request_timeout_s)
        deadline = time.monotonic() + self.settings.request_timeout_s + 1.0
        try:
            while True:
                done, _ = await asyncio.wait({job.future}, timeout=DISCONNECT_POLL_S)
                if done:
                    break
                if await request.is_disconnected():
                    self.batcher.cancel(job)
                    raise asyncio.CancelledError("client disconnected")
                if time.monotonic() > deadline:
                    self.batcher.cancel(job, "timeout")
                    raise Timeout(f"not served within {self.settings.request_timeout_s:g}s")
        except asyncio.CancelledError:
            self.batcher.cancel(job)
            raise
        embeddings = job.future.result()
        return EmbedResult(embeddings, sum(len(r) for r in ids))

    # ---- runtime switches (run on the batcher thread, between batches) ---------------------------
    def _publish_backends(self) -> None:
        # ops the model does not call are left out: a dashboard row saying "torch" for them would read as a fallback
        self.metrics.set_backends(self.embedder.selection.used, self.embedder.fused)

    def _on_mismatch(self, reason: str) -> None:
        """The verifier saw fused outputs differ from the reference (verify_action=fallback): every op the model
        calls falls back to the reference, through the Embedder, as the fused switch would."""
        def apply() -> None:
            e = self.embedder
            if e.fallback:
                return
            ops = list(e.selection.used)
            e.fall_back("all", reason)
            for op in ops:
                self.metrics.fallbacks.labels(op, reason).inc()
            self._publish_backends()
            log.error("fallback: every op now runs on the reference path (%s)", reason)

        self.batcher.call_between_batches(apply)

    def set_fused(self, enabled: bool) -> dict:
        """The admin switch: select again with the fused path on or off (clears a fallback)."""
        def apply() -> dict:
            self.embedder.set_fused(enabled)
            self._publish_backends()
            return self.embedder.describe()

        return self.batcher.call_between_batches(apply).result(timeout=120)

    def info(self) -> dict:
        s, e = self.settings, self.embedder
        return {
            "model": self.model_name,
            "dim": self.dim if e else None,
            "max_seq_length": e.config.max_seq_length if e else None,
            "device": str(e.device) if e else None,
            "dtype": str(e.dtype).removeprefix("torch.") if e else None,
            "ready": self.ready,
            **(e.describe() if e else {"fused": False, "fallback": None, "kernels": {}}),
            "batching": {"max_batch_tokens": s.max_batch_tokens, "max_batch_requests": s.max_batch_requests,
                         "max_wait_ms": s.max_wait_ms, "max_queue": s.max_queue,
                         "max_client_batch": s.max_client_batch, "request_timeout_s": s.request_timeout_s,
                         "overlap_batches": s.overlap_batches,
                         "batches": self.batcher.batches if self.batcher else 0,
                         "overlapped": self.batcher.overlapped if self.batcher else 0},
            "verify": {"sample_rate": s.verify_sample_rate, "action": s.verify_action,
                       "tolerance": s.verify_tolerance},
        }
