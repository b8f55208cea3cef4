"""The serving core the routes share: model load and warm-up (in the background, so the port answers from the
start), the batcher and verifier, the embed path (validate -> tokenize off the event loop -> enqueue -> await,
watching for client disconnects), output types, and the runtime switches (fused path on/off, fallback). The model
is a black box here: every kernel decision is the Embedder's, asked for between batches on the batcher's thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from starlette.requests import Request

from model.runner import Embedder, LoadReport
from model.tokenizer import InputTooLong
from server.batcher import Batcher, l2_normalize
from server.config import Settings
from server.errors import BadRequest, PayloadTooLarge, ServiceError, Timeout, Unavailable, Unprocessable
from server.metrics import Metrics
from server.observability import CURRENT
from server.quantize import CALIBRATION_TEXTS, QUANTIZED, encode, ranges_of
from server.verify import Verifier

log = logging.getLogger("fusedserve")

VERSION = "0.1.0"
DISCONNECT_POLL_S = 0.05
# Inputs this short are tokenized on the event loop: a hop to a worker thread and back costs several times what
# tokenizing a sentence does, a real share of a single request's latency on a GPU. Longer inputs go to a thread (the
# tokenizer releases the GIL there).
INLINE_TOKENIZE_CHARS = 512


@dataclass
class EmbedResult:
    embeddings: np.ndarray  # [n, dim] float32
    tokens: int


class _LoadedGraphs:
    """The CUDA-graph counters of whatever model is loaded (none yet: zeros), so the metric families exist from
    the first scrape, while the model still loads."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def stats(self) -> dict:
        graphs = self.service.embedder.graphs if self.service.embedder is not None else None
        return graphs.stats() if graphs is not None else {}


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
        # start-up as /readyz reports it; written by the loading thread only
        self.phase, self.progress = "starting", None
        self.load_error: str | None = None
        self.on_fatal: Callable[[], None] | None = None  # python -m server: stop the process when loading fails
        self.created = int(time.time())
        self._started = time.monotonic()
        self._calibration: np.ndarray | None = None  # raw embeddings of CALIBRATION_TEXTS
        self._ranges: dict[tuple[bool, int | None], np.ndarray] = {}
        self._calibrating: asyncio.Lock | None = None
        self.tracing = None
        if settings.otlp_endpoint:
            from server.tracing import Tracing

            self.tracing = Tracing(settings.otlp_endpoint, settings.otel_service_name, VERSION)
        self.metrics.watch_cuda_graphs(_LoadedGraphs(self))

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

    def start(self) -> threading.Thread:
        """Load, warm up and calibrate on a thread of its own, then ready; the event loop serves meanwhile (the
        probes, and 503 with the phase everywhere else). A failure is logged with its traceback, /readyz reports
        it, and on_fatal (set by `python -m server`) stops the process. A daemon thread: a SIGTERM during the
        load ends the process without waiting for it."""
        thread = threading.Thread(target=self._start_up, name="fusedserve-load", daemon=True)
        thread.start()
        return thread

    def _start_up(self) -> None:
        try:
            self.load()
            if self.settings.warmup and not self.draining:
                self.warm_up()
            if not self.draining:
                self.mark_ready()
                log.warning("ready\n%s", self.startup_report())
        except BaseException as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.critical("start-up failed while %s; stopping", self.phase, exc_info=True)
            self.phase = "failed"
            if self.on_fatal is not None:
                self.on_fatal()

    def readiness(self) -> dict:
        """/readyz's body: ready, draining, failed, or loading with the phase and its progress (0..1 where known)."""
        if self.draining:
            return {"status": "draining"}
        if self.ready:
            return {"status": "ready"}
        if self.load_error is not None:
            return {"status": "failed", "phase": self.phase, "reason": self.load_error}
        return {"status": "loading", "phase": self.phase, "progress": self.progress,
                "elapsed_s": round(time.monotonic() - self._started, 1)}

    def _enter(self, phase: str, progress: float | None = None) -> None:
        self.phase, self.progress = phase, progress

    def load(self) -> None:
        s = self.settings
        self._enter("loading")
        if s.torch_threads:
            torch.set_num_threads(s.torch_threads)
        log.info("loading model %s on device %s (dtype %s) ...", s.model, s.device, s.dtype)
        self.embedder, self.report = Embedder.load(
            s.model, device=s.device, dtype=s.dtype, fused=s.fused, backend=s.backend,
            backend_overrides=dict(s.backend_overrides), max_seq_length=s.max_seq_length, pooling=s.pooling,
            attention=s.attention,
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

    def warm_up(self) -> None:
        """The model's warm-up batches (the largest shape, and a small one), so autotuning and allocation happen
        before ready, then the CUDA graphs, then the calibration of the int8/uint8 output types."""
        s, e = self.settings, self.embedder
        started = time.perf_counter()
        batches = e.warmup_batches()
        for i, batch in enumerate(batches):
            self._enter("warmup", i / len(batches))
            log.info("warm-up: batch of %d x %d tokens", len(batch), max(map(len, batch)))
            self.batcher.call_between_batches(lambda batch=batch: e.embed_ids(batch)).result()
        if e.graphs is not None and s.cuda_graph_warmup:
            self._enter("cuda_graphs", 0.0)
            self._capture_graphs()
        self._enter("calibration")
        self._calibration = self.batcher.call_between_batches(self._embed_calibration).result()
        log.info("warm-up done in %.1fs", time.perf_counter() - started)

    def _capture_graphs(self) -> None:
        """Every reachable CUDA-graph bucket, on the worker thread, before ready: under traffic a capture would
        stall its batch for the capture (and the autotuning of a first-seen row count)."""
        started = time.perf_counter()

        def progress(done: int, todo: int) -> None:
            self.progress = done / max(todo, 1)
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
        if self.tracing:
            self.tracing.shutdown()

    @property
    def model_name(self) -> str:
        if self.settings.model_name:
            return self.settings.model_name
        return self.embedder.name if self.embedder else self.settings.model

    @property
    def dim(self) -> int:
        return self.embedder.dim

    # ---- the embed path ---------------------------------------------------------------------------
    def check_ready(self) -> None:
        if self.draining:
            raise Unavailable("the server is shutting down", headers={"Retry-After": "1"})
        if not self.ready:
            if self.load_error is not None:
                raise Unavailable(f"the model failed to load ({self.load_error})")
            progress = f", {self.progress:.0%}" if self.progress is not None else ""
            raise Unavailable(f"the model is still loading ({self.phase}{progress})", headers={"Retry-After": "5"})

    def check_count(self, n: int) -> None:
        if n == 0:
            raise BadRequest("no inputs given")
        if n > self.settings.max_client_batch:
            raise PayloadTooLarge(f"{n} inputs in one request; the limit is {self.settings.max_client_batch}")

    def apply_prompt(self, texts: list[str], prompt_name: str | None) -> list[str]:
        """sentence-transformers' prompts: the named prompt's text goes before each input. The Embedder decides
        what a name stands for where it can (Embedder.prompt, which also knows a model's default prompt); a model
        without prompts refuses the field rather than ignoring it."""
        try:
            prompt = self.embedder.prompt(prompt_name)
        except ValueError as exc:
            raise Unprocessable(str(exc), param="prompt_name") from None
        return [prompt + text for text in texts] if prompt else texts

    async def tokenize(self, texts: list[str], *, truncate: bool, direction: str = "right") -> list[list[int]]:
        """Token ids per text ([CLS] ... [SEP]); over-long inputs are cut on `direction`'s side, or with
        truncate=False refused (413). Short requests run on the event loop, long ones on a worker thread."""
        for i, text in enumerate(texts):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # the HTTP routes' JSON parser already refuses lone surrogates ("\ud800");
                # a Python caller's strings can still hold them, and the tokenizer cannot take them
                raise Unprocessable(f"input {i} is not valid Unicode (lone surrogate)") from None
        tokenizer = self.embedder.tokenizer
        pipeline = self.embedder.pipeline
        if pipeline is not None and pipeline.do_lower_case:  # as sentence-transformers' Transformer module does
            texts = [t.lower() for t in texts]

        def encode() -> list[list[int]]:
            if direction == "left":
                return self.cut([e.ids for e in tokenizer.untruncated.encode_batch(texts)], truncate, "left")
            return tokenizer.encode(texts, truncate)

        started = time.monotonic()
        try:
            if sum(map(len, texts)) <= INLINE_TOKENIZE_CHARS:
                ids = encode()
            else:
                ids = await asyncio.to_thread(encode)
        except InputTooLong as exc:
            raise PayloadTooLarge(str(exc)) from None
        record = CURRENT.get()
        if record is not None:
            record.tokenized(started, time.monotonic(), len(texts))
        return ids

    async def embed_texts(self, texts: list[str], *, normalize: bool, truncate: bool, request: Request,
                          direction: str = "right", prompt_name: str | None = None) -> EmbedResult:
        """Texts in, embeddings out; the named prompt (or the model's default prompt) goes before each text."""
        self.check_ready()
        self.check_kind("embedding")
        self.check_count(len(texts))
        texts = self.apply_prompt(texts, prompt_name)
        ids = await self.tokenize(texts, truncate=truncate, direction=direction)
        return await self.embed_ids(ids, normalize=normalize, request=request)

    def cut(self, rows: list[list[int]], truncate: bool, direction: str = "right") -> list[list[int]]:
        """Rows over max_seq_length cut to it, keeping the first and last token ([CLS], [SEP]) and dropping from the
        end (right) or the start (left) of the text; with truncate=False an over-long row is a 413."""
        limit = self.embedder.config.max_seq_length
        out = []
        for i, row in enumerate(rows):
            if len(row) > limit:
                if not truncate:
                    raise PayloadTooLarge(f"input {i} has {len(row)} tokens, over the limit of {limit}")
                row = row[: limit - 1] + [row[-1]] if direction == "right" else [row[0]] + row[len(row) - limit + 1:]
            out.append(row)
        return out

    def validate_ids(self, rows: list[list[int]], truncate: bool, direction: str = "right") -> list[list[int]]:
        vocab = self.embedder.config.vocab_size
        for i, row in enumerate(rows):
            if not row:
                raise Unprocessable(f"input {i} is an empty token list")
            if min(row) < 0 or max(row) >= vocab:  # min/max run in C; the offender is looked up only on failure
                bad = next(t for t in row if not 0 <= t < vocab)
                raise Unprocessable(f"input {i} has token id {bad} outside the vocabulary [0, {vocab})")
        return self.cut(rows, truncate, direction)

    def check_kind(self, kind: str) -> None:
        """An embedding route on a classifier, or a classifier route on an embedding model: a 4xx naming both."""
        served = self.embedder.kind
        if served != kind:
            use = "/rerank, /v1/rerank or /predict" if served == "classifier" else "/infer, /embed or /v1/embeddings"
            raise Unprocessable(f"this route serves {kind} models; {self.model_name} is a{'n' * (served[0] in 'ae')} "
                                f"{served} model: use {use}")

    async def embed_ids(self, ids: list[list[int]], *, normalize: bool, request: Request,
                        kind: str = "embedding") -> EmbedResult:
        """The model's output rows for token-id rows: embeddings, or a classifier's logits (kind="classifier")."""
        self.check_ready()
        self.check_kind(kind)
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
        tokens = sum(len(r) for r in ids)
        record = CURRENT.get()
        if record is not None and job.started is not None and job.done is not None:
            record.served(job.enqueued, job.started, job.done, len(ids), tokens)
        return EmbedResult(embeddings, tokens)

    async def embed_tokens(self, ids: list[list[int]]) -> list[np.ndarray]:
        """Per-token hidden states ([tokens, dim] float32 per input, special tokens included), as one forward on
        the batcher's thread between batches."""
        self.check_ready()
        self.check_kind("embedding")
        self.check_count(len(ids))
        total = sum(map(len, ids))
        if total > self.settings.max_batch_tokens:
            raise PayloadTooLarge(f"{total} tokens in one request; per-token output is limited to max_batch_tokens "
                                  f"({self.settings.max_batch_tokens})")
        stamps: dict[str, float] = {}

        def run() -> list[np.ndarray]:
            stamps["started"] = time.monotonic()
            try:
                return [t.numpy() for t in self.embedder.embed_tokens(ids)]
            finally:
                stamps["done"] = time.monotonic()

        enqueued = time.monotonic()
        try:
            rows = await asyncio.wait_for(asyncio.wrap_future(self.batcher.call_between_batches(run)),
                                          timeout=self.settings.request_timeout_s)
        except asyncio.TimeoutError:
            raise Timeout(f"not served within {self.settings.request_timeout_s:g}s") from None
        record = CURRENT.get()
        if record is not None:
            record.served(enqueued, stamps["started"], stamps["done"], len(ids), total)
        return rows

    # ---- output types -----------------------------------------------------------------------------
    def _embed_calibration(self) -> np.ndarray:
        """Raw embeddings of CALIBRATION_TEXTS, on the worker (in batches the limits allow)."""
        e, step = self.embedder, min(self.settings.max_batch_requests, 32)
        ids = e.tokenizer.encode(list(CALIBRATION_TEXTS), True)
        return np.concatenate([e.embed_ids(ids[i: i + step], normalize=False).numpy()
                               for i in range(0, len(ids), step)]).astype(np.float32)

    async def quantization_ranges(self, normalize: bool, dimensions: int | None) -> np.ndarray:
        """[2, width] per-dimension min and max of the calibration embeddings, shaped as the request's own are."""
        if self._calibration is None:
            self._calibrating = self._calibrating or asyncio.Lock()
            async with self._calibrating:
                if self._calibration is None:
                    future = self.batcher.call_between_batches(self._embed_calibration)
                    self._calibration = await asyncio.wrap_future(future)
        key = (normalize, dimensions)
        if key not in self._ranges:
            self._ranges[key] = ranges_of(self._calibrated(normalize, dimensions))
        return self._ranges[key]

    def _calibrated(self, normalize: bool, dimensions: int | None) -> np.ndarray:
        """The calibration embeddings as a request gets its own: the first `dimensions` of each, normalized or raw."""
        matrix = self._calibration if dimensions is None else self._calibration[:, :dimensions]
        return l2_normalize(matrix) if normalize else matrix

    def check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is not None and not 1 <= dimensions <= self.dim:
            raise BadRequest(f"dimensions must be between 1 and {self.dim}", param="dimensions")

    @staticmethod
    def shape(matrix: np.ndarray, *, normalize: bool, dimensions: int | None) -> np.ndarray:
        """The first `dimensions` columns, renormalized when the request asked for normalized embeddings (the
        rows of `matrix` already are normalized or raw as it asked)."""
        if dimensions is None or dimensions >= matrix.shape[1]:
            return matrix
        matrix = matrix[:, :dimensions]
        return l2_normalize(matrix) if normalize else matrix

    async def output(self, matrix: np.ndarray, encoding: str, *, normalize: bool, dimensions: int | None = None):
        """The embeddings as the request asked for them: width, then output type (server.quantize)."""
        matrix = self.shape(matrix, normalize=normalize, dimensions=dimensions)
        ranges = await self.quantization_ranges(normalize, dimensions) if encoding in QUANTIZED else None
        return encode(matrix, encoding, ranges)

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
        """The admin switch: select again with the fused path on or off (clears a fallback). A selection that cannot
        be made (a forced backend failing its self-test) leaves the path as it was and answers 503 saying why."""
        def apply() -> dict:
            self.embedder.set_fused(enabled)
            self._publish_backends()
            return self.embedder.describe()

        future = self.batcher.call_between_batches(apply)
        try:
            return future.result(timeout=120)
        except concurrent.futures.TimeoutError:
            raise Timeout("the switch did not finish within 120 s; it still applies between batches") from None
        except ServiceError:
            raise
        except Exception as exc:  # the Embedder kept its previous selection
            raise Unavailable(f"the kernel path was not changed: {type(exc).__name__}: {exc}") from exc

    def info(self) -> dict:
        s, e = self.settings, self.embedder
        return {
            "model": self.model_name,
            "dim": self.dim if e else None,
            "max_seq_length": e.config.max_seq_length if e else None,
            "device": str(e.device) if e else None,
            "dtype": str(e.dtype).removeprefix("torch.") if e else None,
            "ready": self.ready,
            "phase": "ready" if self.ready else self.phase,
            **(e.describe() if e else {"fused": False, "fallback": None, "kernels": {}}),
            "batching": {"max_batch_tokens": s.max_batch_tokens, "max_batch_requests": s.max_batch_requests,
                         "max_wait_ms": s.max_wait_ms, "max_queue": s.max_queue,
                         "max_client_batch": s.max_client_batch, "request_timeout_s": s.request_timeout_s,
                         "overlap_batches": s.overlap_batches,
                         "batches": self.batcher.batches if self.batcher else 0,
                         "overlapped": self.batcher.overlapped if self.batcher else 0},
            "verify": {"sample_rate": s.verify_sample_rate, "action": s.verify_action,
                       "tolerance": s.verify_tolerance},
            # int8/uint8 calibration (server.quantize): per-dimension [min, max] of normalized embeddings
            "quantization": None if self._calibration is None else {
                "calibration_texts": len(CALIBRATION_TEXTS),
                "ranges": ranges_of(self._calibrated(True, None)).tolist()},
        }
