"""The serving core the routes share: model load and warm-up, the batcher and verifier, the embed path
(validate -> tokenize off the event loop -> enqueue -> await, watching for client disconnects) and the
runtime switches (fused path on/off, fallback, test-only faults)."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
from starlette.requests import Request

from kernels import reference, registry
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
        self.ready = False
        self.draining = False
        self.embedder: Embedder | None = None
        self.report: LoadReport | None = None
        self.batcher: Batcher | None = None
        self.verifier: Verifier | None = None
        self.fallback_reason: str | None = None
        self.faults: dict[str, dict] = {}
        self.graph_warmup: tuple[int, float] | None = None  # (graphs captured at start-up, seconds)

    # ---- lifecycle --------------------------------------------------------------------------------
    def load(self) -> None:
        s = self.settings
        if s.torch_threads:
            torch.set_num_threads(s.torch_threads)
        if s.gil_switch_interval_ms:
            sys.setswitchinterval(s.gil_switch_interval_ms / 1e3)
        log.info("loading model %s on device %s (dtype %s) ...", s.model, s.device, s.dtype)
        self.embedder, self.report = Embedder.load(
            s.model, device=s.device, dtype=s.dtype, fused=s.fused, backend=s.backend,
            backend_overrides=dict(s.backend_overrides), max_seq_length=s.max_seq_length, layout=s.layout,
            attention=s.attention,
            cuda_graphs=s.cuda_graphs, max_batch_tokens=s.max_batch_tokens, max_batch=s.max_batch_requests,
            max_graphs=s.max_cuda_graphs)
        if s.verify_sample_rate > 0:
            self.verifier = Verifier(self.embedder, s, self.metrics, self._on_mismatch)
            self.verifier.start()
        self.batcher = Batcher(self.embedder, s, self.metrics,
                               on_batch=self.verifier.submit if self.verifier else None)
        self.batcher.start()
        self._publish_backends()
        self.metrics.watch_device_memory(self.embedder.device)
        self.metrics.watch_cuda_graphs(self.embedder.graphs)

    def warm_up(self) -> None:
        """Run the largest batch shape (and a small one) so autotuning and allocation happen before ready."""
        s, e = self.settings, self.embedder
        seq = e.config.max_seq_length
        rows = max(1, min(s.max_batch_requests, s.max_batch_tokens // seq))
        started = time.perf_counter()
        for shape in ((rows, seq), (1, 8)):
            log.info("warm-up: batch of %d x %d tokens", *shape)
            ids = [[101] + [1000 + i % 5000 for i in range(shape[1] - 2)] + [102]] * shape[0]
            self.batcher.call_between_batches(lambda ids=ids: e.embed_ids(ids)).result()
        if e.graphs is not None and s.cuda_graph_warmup:
            self._capture_graphs()
        log.info("warm-up done in %.1fs", time.perf_counter() - started)

    def _capture_graphs(self) -> None:
        """Every reachable CUDA-graph bucket, on the worker thread, before ready: under traffic a capture would
        stall its batch for the capture (and the autotuning of a first-seen row count)."""
        graphs, started = self.embedder.graphs, time.perf_counter()

        def progress(done: int, todo: int) -> None:
            if done % max(todo // 10, 1) == 0 or done == todo:
                log.warning("capturing CUDA graphs: %d/%d (%.1fs)", done, todo, time.perf_counter() - started)

        captured = self.batcher.call_between_batches(lambda: graphs.capture_all(progress)).result()
        if captured:
            self.graph_warmup = (captured, time.perf_counter() - started)

    def startup_report(self) -> str:
        s = self.settings
        e = self.embedder
        if e.graphs is None:
            graphs = "CUDA graphs off"
        elif self.graph_warmup is not None:
            graphs = (f"CUDA graphs on: {self.graph_warmup[0]} buckets captured at start-up in "
                      f"{self.graph_warmup[1]:.1f}s (up to {s.max_cuda_graphs} held)")
        else:
            graphs = f"CUDA graphs on (up to {s.max_cuda_graphs}, captured per shape bucket on first use)"
        if e.device.type == "cuda" and any(c.backend == "triton" for c in registry.current().choices.values()):
            from kernels.triton._common import pdl_enabled  # importable: Triton runs an op here

            graphs += f", Triton programmatic dependent launch {'on' if pdl_enabled(e.device) else 'off'}"
        return (f"{self.report}\nlayout {e.layout}, attention {e.attention} ({e.attention_reason}), {graphs}\n"
                f"batching: max_batch_tokens {s.max_batch_tokens}, max_batch_requests "
                f"{s.max_batch_requests}, max_wait_ms {s.max_wait_ms:g}, max_queue {s.max_queue}"
                f"{f', idle_poll_ms {s.idle_poll_ms:g}' if s.idle_poll_ms else ''}; "
                f"verify_sample_rate {s.verify_sample_rate:g} ({s.verify_action}), "
                f"kernel_timing_sample_rate {s.kernel_timing_sample_rate:g}")

    def shutdown(self) -> None:
        self.draining = True
        self.ready = False
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
        selection = registry.current()
        # ops the model does not call are left out: a dashboard row saying "torch" for them would read as a fallback
        choices = {op: c.backend for op, c in selection.choices.items() if c.used} if selection else {}
        if self.fallback_reason:
            choices = {op: registry.REFERENCE_BACKEND for op in choices}
        self.metrics.set_backends(choices, selection.fused and not self.fallback_reason if selection else False)

    def _on_mismatch(self, reason: str) -> None:
        def apply() -> None:
            if self.fallback_reason:
                return
            self.fallback_reason = reason
            registry.active.update(reference.OPS)
            self.faults.clear()
            for op in registry.OPS:
                self.metrics.fallbacks.labels(op, reason).inc()
            self._publish_backends()
            log.error("fallback: every op now runs on the reference path (%s)", reason)

        self.batcher.call_between_batches(apply)

    def set_fused(self, enabled: bool) -> dict:
        s, e = self.settings, self.embedder

        def apply():
            self.faults.clear()
            self.fallback_reason = None
            e.configure_kernels(backend=s.backend, overrides=dict(s.backend_overrides), fused=enabled)
            self._publish_backends()
            return registry.current().as_dict()

        return self.batcher.call_between_batches(apply).result(timeout=120)

    def set_fault(self, op: str, mode: str, factor: float) -> None:
        """Test-only: make one active op raise, drift by `factor`, emit NaN, stall `factor` seconds, or run
        out of memory on inputs of more than `factor` rows."""

        def apply():
            original = self.faults.get(op, {}).get("original", registry.active[op])

            def faulty(*args, **kwargs):
                if mode == "raise":
                    raise RuntimeError(f"injected fault in {op}")
                if mode == "delay":
                    time.sleep(factor)
                    return original(*args, **kwargs)
                if mode == "oom" and args[0].shape[0] > factor:
                    raise torch.cuda.OutOfMemoryError(f"injected out-of-memory in {op} ({args[0].shape[0]} rows)")
                out = original(*args, **kwargs)
                if mode == "oom":
                    return out
                first = out[0] if isinstance(out, tuple) else out
                if mode == "nan":
                    first.fill_(float("nan"))
                else:
                    first.mul_(factor)
                return out

            registry.active[op] = faulty
            self.faults[op] = {"mode": mode, "factor": factor, "original": original}

        self.batcher.call_between_batches(apply).result(timeout=10)

    def clear_faults(self) -> None:
        def apply():
            for op, fault in self.faults.items():
                registry.active[op] = fault["original"]
            self.faults.clear()

        self.batcher.call_between_batches(apply).result(timeout=10)

    def info(self) -> dict:
        s = self.settings
        selection = registry.current()
        return {
            "model": self.model_name,
            "dim": self.dim if self.embedder else None,
            "max_seq_length": self.embedder.config.max_seq_length if self.embedder else None,
            "device": str(self.embedder.device) if self.embedder else None,
            "dtype": str(self.embedder.dtype).removeprefix("torch.") if self.embedder else None,
            "ready": self.ready,
            "fused": bool(selection and selection.fused and not self.fallback_reason),
            "fallback": self.fallback_reason,
            "kernels": selection.as_dict()["ops"] if selection else {},
            "faults": {op: {k: v for k, v in f.items() if k != "original"} for op, f in self.faults.items()},
            "batching": {"max_batch_tokens": s.max_batch_tokens, "max_batch_requests": s.max_batch_requests,
                         "max_wait_ms": s.max_wait_ms, "max_queue": s.max_queue,
                         "max_client_batch": s.max_client_batch, "request_timeout_s": s.request_timeout_s,
                         "overlap_batches": s.overlap_batches, "idle_poll_ms": s.idle_poll_ms,
                         "batches": self.batcher.batches if self.batcher else 0,
                         "overlapped": self.batcher.overlapped if self.batcher else 0},
            "verify": {"sample_rate": s.verify_sample_rate, "action": s.verify_action,
                       "tolerance": s.verify_tolerance},
            "layout": self.embedder.layout if self.embedder else s.layout,
            "attention": self.embedder.attention if self.embedder else s.attention,
            "attention_reason": self.embedder.attention_reason if self.embedder else None,
            "cuda_graphs": (self.embedder.graphs.stats() if self.embedder and self.embedder.graphs
                            else {"enabled": False}),
            "cuda_launch_configs": self._cuda_launch_configs(selection),
        }

    @staticmethod
    def _cuda_launch_configs(selection) -> dict:
        """The CUDA backend's tuned launch configurations so far (kernel|dtype|width|row bucket -> config)."""
        if not selection or not any(c.backend == "cuda" for c in selection.choices.values()):
            return {}
        from kernels.cuda.tuning import TUNER

        return TUNER.table()
