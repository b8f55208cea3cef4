"""One model of the server: its Embedder on the shared device, its batcher and verifier, and the embed path the
routes call (validate -> tokenize off the event loop -> enqueue -> await, watching for client disconnects), output
types, and the runtime switches (fused path on/off, fallback). The model is a black box here: every kernel decision
is the Embedder's, asked for between batches on this model's batcher thread. server.service.Service holds the
models, routes requests to them and runs the start-up."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import itertools
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from starlette.requests import Request

from fusedserve.model.runner import Embedder, LoadReport
from fusedserve.model.tokenizer import InputTooLong
from fusedserve.server.batcher import Batcher, l2_normalize
from fusedserve.server.config import ModelSpec
from fusedserve.server.errors import BadRequest, PayloadTooLarge, ServiceError, Timeout, Unavailable, Unprocessable
from fusedserve.server.metrics import ModelMetrics
from fusedserve.server.observability import CURRENT
from fusedserve.server.quantize import CALIBRATION_TEXTS, QUANTIZED, encode, ranges_of
from fusedserve.server.verify import Verifier

if TYPE_CHECKING:
    from fusedserve.server.service import Service

log = logging.getLogger("fusedserve")

DISCONNECT_POLL_S = 0.05
# Inputs this short are tokenized on the event loop: a hop to a worker thread and back costs several times what
# tokenizing a sentence does, a real share of a single request's latency on a GPU. Longer inputs go to a thread (the
# tokenizer releases the GIL there).
INLINE_TOKENIZE_CHARS = 512
# a model's start-up, as /readyz and /info report it: phases move forward, to ready (every model loaded, the server
# serves) or failed
PHASES = ("waiting", "loading", "warmup", "cuda_graphs", "calibration", "loaded", "ready", "failed")


@dataclass
class EmbedResult:
    embeddings: np.ndarray  # [n, dim] float32
    tokens: int


def _bytes_of(*modules: torch.nn.Module) -> int:
    """Bytes of the modules' parameters and buffers (each tensor once, however often it is shared)."""
    seen, total = set(), 0
    for tensor in itertools.chain.from_iterable(itertools.chain(m.parameters(), m.buffers()) for m in modules):
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


# after ready, the longest that batches without their CUDA graph run eagerly while the rest are captured when idle
CAPTURE_AHEAD_S = 120.0


def refreeze() -> None:
    """One full collection, then every surviving object frozen out of the collector's sight: before ready (the
    start's objects), and after a switch dropped the start's selection and graphs, so cycles among the dropped objects
    (graphs holding device memory) are freed. After a switch it runs on the worker thread, between batches: the pause
    delays the next batch once per switch."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


class ModelService:
    def __init__(self, server: Service, name: str | None, spec: ModelSpec) -> None:
        """name: what clients call it (None: the name its checkpoint gives, known once loaded)."""
        self.server, self.settings, self.spec = server, server.settings, spec
        self._name = name
        self.embedder: Embedder | None = None
        self.report: LoadReport | None = None
        self.metrics: ModelMetrics | None = None  # once loaded, under the model's name
        self.batcher: Batcher | None = None
        self.verifier: Verifier | None = None
        self.graph_warmup: tuple[int, float] | None = None  # (graphs captured before ready, seconds)
        self.graphs_after_ready: tuple[int, float] | None = None  # (the rest, captured while idle; seconds)
        self.warmup_seconds: dict[str, float] = {}  # phase -> seconds, for the start-up report
        # start-up as /readyz and /info report it; written by the loading thread only
        self.phase, self.progress = "waiting", None
        self.load_error: str | None = None  # why it failed to load (model_load_failure=skip)
        self.memory: dict[str, int] = {}
        self._calibration: np.ndarray | None = None  # raw embeddings of CALIBRATION_TEXTS
        self._ranges: dict[tuple[bool, int | None], np.ndarray] = {}
        self._calibrating: asyncio.Lock | None = None

    @property
    def name(self) -> str:
        if self._name:
            return self._name
        return self.embedder.name if self.embedder is not None else self.spec.path

    @property
    def kind(self) -> str | None:
        """"embedding" or "classifier" once loaded."""
        return self.embedder.kind if self.embedder is not None else None

    @property
    def dim(self) -> int:
        return self.embedder.dim

    # ---- start-up and shutdown (the server's loading thread) ----------------------------------------
    def _enter(self, phase: str, progress: float | None = None) -> None:
        self.phase, self.progress = phase, progress

    def start(self) -> None:
        """Load, then (with `warmup`) warm up and calibrate: loaded. The server marks every loaded model ready (and
        itself) once all have loaded."""
        self.load()
        if self.settings.warmup and not self.server.draining:
            self.warm_up()
        self._enter("loaded")

    def load(self) -> None:
        s, spec = self.settings, self.spec
        self._enter("loading")
        log.info("loading model %s%s on device %s (dtype %s) ...", f"{self._name}: " if self._name else "", spec.path,
                 s.device, s.dtype)
        self.embedder, self.report = Embedder.load(
            spec.path, device=s.device, dtype=s.dtype, fused=s.fused, backend=s.backend,
            backend_overrides=dict(s.backend_overrides),
            max_seq_length=spec.max_seq_length if spec.max_seq_length is not None else s.max_seq_length,
            pooling=spec.pooling if spec.pooling is not None else s.pooling, attention=s.attention,
            cuda_graphs=s.cuda_graphs, max_batch_tokens=s.max_batch_tokens, max_batch=s.max_batch_requests,
            max_graphs=s.max_cuda_graphs)
        self._name = self.name  # the name the checkpoint gives, where none was configured: fixed from here on
        self.metrics = self.server.metrics.for_model(self.name)
        self.server.metrics.model_ready.labels(self.name).set(0)
        if s.verify_sample_rate > 0:
            self.verifier = Verifier(self.embedder.reference_copy(), s, self.metrics, self._on_mismatch)
            self.verifier.start()
        self.batcher = Batcher(self.embedder, s, self.metrics,
                               on_batch=self.verifier.submit if self.verifier else None)
        self.batcher.start()
        self._publish_backends()
        self.server.metrics.watch_device_memory(self.embedder.device)
        self.memory = {"parameters_bytes": _bytes_of(self.embedder.encoder, self.embedder.head)}
        if self.verifier is not None:  # the verifier's fp32 copy lives on the same device
            self.memory["reference_copy_bytes"] = _bytes_of(self.verifier.reference.encoder,
                                                            self.verifier.reference.head)

    def warm_up(self) -> None:
        """Before ready, each phase logged with its time: on a GPU, the sweep's kernels compiled side by side
        (Embedder.compile_ahead), then the shape sweep (an eager forward at every launch shape a batch can meet,
        Embedder.shape_sweep: what is compiled and tuned then, no request pays for later), the first
        `cuda_graphs_before_ready` CUDA graphs in order of need, the calibration of the int8/uint8 output types.
        The other graphs are captured after ready (capture_rest); until then a batch without its graph runs
        eagerly."""
        s, e = self.settings, self.embedder
        started = time.perf_counter()
        # on the CPU nothing is compiled or tuned per shape: the largest batch and a short one warm the allocator
        sweep = e.shape_sweep() if e.device.type == "cuda" else e.warmup_batches()
        if e.device.type == "cuda" and "triton" in e.selection.used.values():
            # the sweep's Triton kernels compiled side by side first, not one by one as the sweep meets them
            self._enter("warmup", 0.0)
            try:
                self.batcher.call_between_batches(lambda: e.compile_ahead(sweep)).result()
            except Exception as exc:  # only a head start: the sweep below compiles whatever this did not
                log.warning("warm-up of %s: compiling ahead failed (%s: %s); the shape sweep compiles its kernels "
                            "one by one", self.name, type(exc).__name__, exc)
            else:
                log.warning("warm-up of %s: kernels of %d launch shapes compiled in %.1fs", self.name, len(sweep),
                            time.perf_counter() - started)
            self.warmup_seconds["compiles"] = time.perf_counter() - started
        phase = time.perf_counter()
        for i, batch in enumerate(sweep):
            self._enter("warmup", i / len(sweep))
            self.batcher.call_between_batches(lambda batch=batch: e.embed_ids(batch, graphs=False)).result()
        e.save_tuning()
        self.warmup_seconds["shape sweep"] = time.perf_counter() - phase
        log.warning("warm-up of %s: %d launch shapes run in %.1fs", self.name, len(sweep),
                    self.warmup_seconds["shape sweep"])
        if e.graphs is not None and s.cuda_graph_warmup:
            e.graphs.defer_captures_until = math.inf  # captured ahead from here on: no batch waits for a capture
            self._enter("cuda_graphs", 0.0)
            self._capture_graphs(s.cuda_graphs_before_ready)
        self._enter("calibration")
        phase = time.perf_counter()
        self._calibration = self.batcher.call_between_batches(self._embed_calibration).result()
        self.warmup_seconds["calibration"] = time.perf_counter() - phase
        log.warning("warm-up of %s done in %.1fs", self.name, time.perf_counter() - started)

    def _capture_graphs(self, limit: int) -> None:
        """The first `limit` CUDA-graph buckets in order of need, on the worker thread, before ready."""
        started = time.perf_counter()

        def progress(done: int, todo: int) -> None:
            self.progress = done / max(todo, 1)
            if done % max(todo // 4, 1) == 0 or done == todo:
                log.warning("capturing CUDA graphs of %s: %d/%d (%.1fs)", self.name, done, todo,
                            time.perf_counter() - started)

        captured = self.batcher.call_between_batches(lambda: self.embedder.capture_graphs(progress, limit)).result()
        self.warmup_seconds["cuda graphs"] = time.perf_counter() - started
        self.graph_warmup = (captured, self.warmup_seconds["cuda graphs"])

    def capture_rest(self) -> threading.Thread | None:
        """After ready: the remaining reachable CUDA-graph buckets, one at a time whenever the model is idle (no
        input waiting, no batch in flight), on a thread of its own that only waits; logged when done."""
        e = self.embedder
        if e is None or e.graphs is None or not self.settings.cuda_graph_warmup or not self.settings.warmup:
            return None

        # under traffic that never leaves the model idle, a bucket still missing after this long is captured when
        # its batch comes, as without warm-up
        e.graphs.defer_captures_until = time.monotonic() + CAPTURE_AHEAD_S

        def run() -> None:
            started, count = time.perf_counter(), 0
            try:
                while self.batcher.call_when_idle(e.capture_next_graph).result():
                    count += 1
            except Unavailable:  # shutting down
                return
            except Exception:
                log.exception("capturing the CUDA graphs of %s after ready failed; batches without a graph run "
                              "eagerly, or capture it when they come", self.name)
            finally:
                e.graphs.defer_captures_until = 0.0  # from now on (an evicted bucket, a new selection) on first use
            self.graphs_after_ready = (count, time.perf_counter() - started)
            log.warning("CUDA graphs of %s: %d more buckets captured after ready in %.1fs (while idle)", self.name,
                        count, self.graphs_after_ready[1])

        thread = threading.Thread(target=run, name=f"fusedserve-graphs[{self.name}]", daemon=True)
        thread.start()
        return thread

    def fail(self, exc: BaseException) -> None:
        """model_load_failure=skip: this model failed to load or warm up. Logged once with its traceback, reported
        (start-up report, /readyz, /info, fusedserve_model_ready 0), its threads stopped and its memory let go."""
        self.load_error = f"{type(exc).__name__}: {exc}"
        log.error("model %s failed to load (%s); skipped (model_load_failure=skip)", self.name, self.load_error,
                  exc_info=exc)
        self._enter("failed")
        self.server.metrics.model_ready.labels(self.name).set(0)
        if self.metrics is not None:  # it loaded, then failed: no backend serves its ops any more
            self.metrics.set_backends({}, False)
        self.stop(timeout_s=1.0)
        self.embedder = self.batcher = self.verifier = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def stop(self, timeout_s: float) -> bool:
        """Refuse new work, answer every accepted input (within timeout_s), stop the worker and the verifier."""
        drained = self.batcher.drain(timeout_s=timeout_s) if self.batcher is not None else True
        if self.verifier is not None:
            self.verifier.stop()
        return drained

    def startup_report(self) -> str:
        if self.load_error is not None:
            return f"model {self.name} ({self.spec.path}): FAILED to load, skipped: {self.load_error}"
        phases = ", ".join(f"{phase} {seconds:.1f}s" for phase, seconds in self.warmup_seconds.items())
        warmup = f"\nwarm-up: {phases}" if phases else ""
        if self.graph_warmup is not None:
            warmup += (f"\nCUDA graphs: {self.graph_warmup[0]} buckets captured before ready, "
                       f"{self.embedder.graphs_pending} more to capture while idle")
        memory = ", ".join(f"{k.removesuffix('_bytes').replace('_', ' ')} {v / 2**20:.1f} MiB"
                           for k, v in self.memory.items())
        named = f"serving as {self.name}: " if self.name != self.report.model else ""
        return f"{named}{self.report}\n{self.embedder.report()}{warmup}\nmemory on {self.embedder.device}: {memory}"

    # ---- the embed path ---------------------------------------------------------------------------
    def check_ready(self) -> None:
        """The server is ready (not loading, not draining) and this model loaded."""
        self.server.check_ready()
        if self.load_error is not None:
            raise Unavailable(f"model {self.name!r} failed to load ({self.load_error})")

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
            raise Unprocessable(f"this route serves {kind} models; {self.name} is a{'n' * (served[0] in 'ae')} "
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
            refreeze()
            for op in ops:
                self.metrics.fallbacks.labels(op, reason).inc()
            self._publish_backends()
            log.error("fallback: every op of %s now runs on the reference path (%s)", self.name, reason)

        self.batcher.call_between_batches(apply)

    def set_fused(self, enabled: bool) -> dict:
        """The admin switch: select again with the fused path on or off (clears a fallback). A selection that cannot
        be made (a forced backend failing its self-test) leaves the path as it was and answers 503 saying why."""
        def apply() -> dict:
            self.embedder.set_fused(enabled)
            refreeze()
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
            raise Unavailable(f"the kernel path of {self.name} was not changed: {type(exc).__name__}: {exc}") from exc

    def info(self) -> dict:
        """The model's entry of /info: what it is, where it runs, the memory it holds, its kernel path."""
        e = self.embedder
        entry = {"model": self.name, "path": self.spec.path, "status": self.phase}
        if self.load_error is not None:
            return {**entry, "error": self.load_error}
        if e is None:
            return {**entry, "progress": self.progress}
        return {
            **entry,
            "max_seq_length": e.config.max_seq_length,
            "device": str(e.device),
            "dtype": str(e.dtype).removeprefix("torch."),
            "memory": {**self.memory, **({"cuda_graph_pool_bytes": e.graphs.stats().get("pool_bytes", 0)}
                                         if e.graphs is not None else {})},
            **e.describe(),  # kind, dim, head, labels or prompts, fused, fallback, kernels, attention, CUDA graphs
            "batches": self.batcher.batches if self.batcher else 0,
            "overlapped": self.batcher.overlapped if self.batcher else 0,
            # int8/uint8 calibration (server.quantize): per-dimension [min, max] of normalized embeddings
            "quantization": None if self._calibration is None else {
                "calibration_texts": len(CALIBRATION_TEXTS),
                "ranges": ranges_of(self._calibrated(True, None)).tolist()},
        }
