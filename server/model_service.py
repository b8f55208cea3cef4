"""One model of the server: its ServedModel (fusedserve.model.api, the only thing the server knows of a model), its
batcher and verifier, and the path the routes call: prepare (Preparer: off the event loop when long) -> the batcher
-> one block of output rows -> the output the request asked for. server.service.Service holds the models, says which one a
request means and runs the start-up."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from starlette.requests import Request

from fusedserve.model import load
from fusedserve.model.api import (Description, InputError, InputTooLong, LoadOptions, Rows, ServedModel,
                                  TextOptions, l2_normalize, multi_vector_counts, name_of, split_m3)
from fusedserve.server.batcher import Batcher
from fusedserve.server.calibration import Calibration
from fusedserve.server.config import ModelSpec, Settings
from fusedserve.server.cost import CostModel, cost_model
from fusedserve.server.deadline import Deadline, not_served
from fusedserve.server.errors import BadRequest, PayloadTooLarge, Unprocessable
from fusedserve.server.metrics import Metrics, ModelMetrics
from fusedserve.server.observability import CURRENT, ClientGone
from fusedserve.server.quantize import (MULTI_VECTOR_ENCODINGS, QUANTIZED, SparseRow, encode, sparse_of_rows,
                                        sparse_of_tokens)
from fusedserve.server.switches import Switches, state
from fusedserve.server.verify import Verifier

log = logging.getLogger("fusedserve")

# A request of inputs this short is prepared on the event loop when no other request of the model is being served: a
# hop to a worker thread and back costs several times what tokenizing a sentence does, a real share of a lone
# request's latency on a GPU. Under load every request goes to TickPreparer: the tokenizer lets go of the GIL and
# hands its work to its own threads, and getting the GIL back beside a busy batcher thread holds the event loop up
# (docs/decisions/0024-tokenize-per-tick-under-load.md); gathered per tick, the waits are paid on a worker thread,
# once per tick. Longer inputs always go there.
INLINE_TOKENIZE_CHARS = 512
# a model's start-up, as /readyz and /info report it: phases move forward, to ready (every model loaded, the server
# serves) or failed
PHASES = ("waiting", "loading", "warmup", "cuda_graphs", "calibration", "loaded", "ready", "failed")


# TickPreparer: the most characters of text one thread call prepares for several requests together
PREPARE_CHUNK_CHARS = 32_768


class TickPreparer:
    """Requests not prepared on the event loop (long inputs, and every request while others are being served),
    gathered over one loop tick and prepared on worker threads, one call per chunk of up to PREPARE_CHUNK_CHARS:
    requests of texts alone with the same options as one model.prepare call (the tokenizer spreads one call's texts
    over its threads), each cut back into its own Rows. A thread hop and
    a GIL hand-back per request cost the event loop more than their tokenizing under load (docs/performance.md); per
    tick they are paid once. Preparing a text does not depend on the others beside it, so the rows are those of
    separate calls; a combined call that raises is made again request by request, so each request gets its own
    error, its input indices its own."""

    def __init__(self, prepare: Callable[[Sequence, TextOptions], Rows]) -> None:
        self._prepare = prepare
        self._waiting: list[tuple[Sequence, TextOptions, int, asyncio.Future]] = []
        # its own threads, handed work with submit(): no asyncio future wrapped around each call (the results come
        # back through call_soon_threadsafe); the tokenizer's own threads do the parallel work
        self._threads = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="fusedserve-prepare")

    def __call__(self, inputs: Sequence, options: TextOptions, chars: int) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        if not self._waiting:
            loop.call_soon(self._flush, loop)
        future = loop.create_future()
        self._waiting.append((inputs, options, chars, future))
        return future

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        work, self._waiting = self._waiting, []
        chunk, size = [], 0
        for item in work:
            if chunk and size + item[2] > PREPARE_CHUNK_CHARS:
                self._threads.submit(self._run, loop, chunk)
                chunk, size = [], 0
            chunk.append(item)
            size += item[2]
        self._threads.submit(self._run, loop, chunk)

    def _run(self, loop: asyncio.AbstractEventLoop, chunk: list) -> None:
        """On a worker thread: the chunk's rows (or errors), handed to the loop in one call."""
        try:
            results = self._prepared(chunk)
        except BaseException as exc:  # not the model's InputError (those are per request): nobody waits forever
            results = [(item[3], None, exc) for item in chunk]
        loop.call_soon_threadsafe(_settle_prepared, results)

    def _prepared(self, chunk: list) -> list[tuple[asyncio.Future, Rows | None, Exception | None]]:
        groups: dict[TextOptions | None, list] = {}
        for item in chunk:
            inputs, options = item[0], item[1]
            together = not options.details and all(type(x) is str for x in inputs)
            groups.setdefault(options if together else None, []).append(item)
        results = []
        for options, items in groups.items():
            if options is not None and len(items) > 1:
                try:
                    rows = self._prepare([x for item in items for x in item[0]], options)
                except Exception:
                    pass  # each request alone below: its own error
                else:
                    start = 0
                    for inputs, _, _, future in items:
                        results.append((future, rows.slice(start, start + len(inputs)), None))
                        start += len(inputs)
                    continue
            for inputs, options, _, future in items:
                try:
                    results.append((future, self._prepare(inputs, options), None))
                except Exception as exc:
                    results.append((future, None, exc))
        return results


class Preparer:
    """A model's request inputs (texts, text pairs or token-id rows) as its Rows: a short request on the event loop
    while no other request of the model is being served (INLINE_TOKENIZE_CHARS), every other on TickPreparer's
    threads within the request's deadline. Too much text is a 413 before any is tokenized, an input the model cannot
    take a 413 (too long) or a 422."""

    def __init__(self, prepare: Callable[[Sequence, TextOptions], Rows], settings: Settings) -> None:
        self._prepare, self.settings = prepare, settings
        self._ticks = TickPreparer(prepare)

    async def __call__(self, inputs: Sequence, options: TextOptions, deadline: Deadline | None, *,
                       alone: bool) -> Rows:
        """alone: no other request of the model is being served. deadline: the request's (None: from its arrival,
        server.deadline; made only where a wait needs it)."""
        started = time.monotonic()
        chars = sum(len(x) if isinstance(x, str) else sum(map(len, x)) if isinstance(x, tuple) else 0
                    for x in inputs)
        if chars > self.settings.max_request_chars:
            raise PayloadTooLarge(f"{chars} characters of text in one request; the limit is "
                                  f"{self.settings.max_request_chars} (max_request_chars)")
        try:
            if chars <= INLINE_TOKENIZE_CHARS and alone:
                rows = self._prepare(inputs, options)
            else:
                deadline = deadline or Deadline.of_request(self.settings.request_timeout_s)
                async with asyncio.timeout(deadline.left()):
                    rows = await self._ticks(inputs, options, chars)
        except TimeoutError:
            raise not_served(self.settings.request_timeout_s) from None
        except InputTooLong as exc:
            raise PayloadTooLarge(str(exc), param=exc.param) from None
        except InputError as exc:
            raise Unprocessable(str(exc), param=exc.param) from None
        record = CURRENT.get()
        if record is not None:
            record.tokenized(started, time.monotonic(), len(inputs))
        return rows


def _settle_prepared(results: list) -> None:
    for future, rows, error in results:
        if future.done():  # its request timed out or went away
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(rows)


@dataclass
class Result:
    rows: np.ndarray  # [n, width] float32, one row per input: embeddings as the request shaped them, or logits
    tokens: int


class _Expired(Exception):
    pass


def _load_options(settings: Settings, spec: ModelSpec) -> LoadOptions:
    s = settings
    return LoadOptions(
        device=s.device, dtype=s.dtype, fused=s.fused, backend=s.backend, backend_overrides=dict(s.backend_overrides),
        max_seq_length=spec.max_seq_length if spec.max_seq_length is not None else s.max_seq_length,
        pooling=spec.pooling if spec.pooling is not None else s.pooling, attention=s.attention,
        cuda_graphs=s.cuda_graphs, max_batch_tokens=s.max_batch_tokens, max_batch=s.max_batch_requests,
        max_graphs=s.max_cuda_graphs, cache_dir=s.cache_dir or None, precision=s.precision,
        graphs_before_ready=s.cuda_graphs_before_ready if s.cuda_graph_warmup and s.warmup else None)


class Limits:
    """A model's per-request limits that no model input decides: the inputs' count, per-token output, dimensions."""

    def __init__(self, settings: Settings, dim: Callable[[], int]) -> None:
        self.settings, self._dim = settings, dim

    def count(self, n: int) -> None:
        if n == 0:
            raise BadRequest("no inputs given")
        if n > self.settings.max_client_batch:
            raise PayloadTooLarge(f"{n} inputs in one request; the limit is {self.settings.max_client_batch}")

    def token_output(self, tokens: int) -> None:
        """A per-token answer (/tokenize, /decode, /embed_all) covers at most max_batch_tokens tokens: its size
        grows with each token."""
        if tokens > self.settings.max_batch_tokens:
            raise PayloadTooLarge(f"{tokens} tokens in one request; per-token output is limited to "
                                  f"max_batch_tokens ({self.settings.max_batch_tokens})")

    def response_bytes(self, values: int, encoding: str) -> None:
        """A per-token answer of `values` floats in `encoding` (quantize.MULTI_VECTOR_ENCODINGS) takes at most
        max_response_bytes."""
        size = values * MULTI_VECTOR_ENCODINGS[encoding][1]
        if size > self.settings.max_response_bytes:
            smaller = [name for name, (_, per) in MULTI_VECTOR_ENCODINGS.items() if values * per <=
                       self.settings.max_response_bytes]
            raise PayloadTooLarge(f"this answer takes about {size / 2**20:.0f} MiB as {encoding}; the limit is "
                                  f"max_response_bytes ({self.settings.max_response_bytes / 2**20:.0f} MiB)" +
                                  (f": ask for {' or '.join(smaller)}" if smaller else ": send fewer tokens"))

    def dimensions(self, dimensions: int | None) -> None:
        dim = self._dim()
        if dimensions is not None and not 1 <= dimensions <= dim:
            raise BadRequest(f"dimensions must be between 1 and {dim}", param="dimensions")


class ModelService:
    """One model: its start-up (load, warm-up) and shutdown, the request path, its /info entry. Where its inputs are
    prepared (Preparer), its requests' deadlines (server.deadline), its output-type calibration (server.calibration)
    and its runtime switches (server.switches) are their own objects."""

    def __init__(self, settings: Settings, metrics: Metrics, name: str | None, spec: ModelSpec) -> None:
        """name: what clients call it (None: the name its path gives, model.api.name_of)."""
        self.settings, self.server_metrics, self.spec = settings, metrics, spec
        self.name = name or name_of(spec.path)
        self.model: ServedModel | None = None
        self.description: Description | None = None  # as of the load or the last switch (Switches.publish)
        self.metrics: ModelMetrics | None = None
        self.batcher: Batcher | None = None
        self.verifier: Verifier | None = None
        self.switches = Switches(self)
        self.calibration: Calibration | None = None  # the int8/uint8 ranges, once loaded
        self.warmup_seconds: dict[str, float] = {}  # phase -> seconds, for the start-up report
        # start-up as /readyz and /info report it; written by the loading thread only
        self.phase, self.progress = "waiting", None
        self.load_error: str | None = None  # why it failed to load (model_load_failure=skip)
        self.limits = Limits(settings, lambda: self.dim)
        self._preparer = Preparer(lambda inputs, options: self.model.prepare(inputs, options), settings)
        self.in_flight = 0  # requests of this model submitted to the batcher and not answered yet (the event loop's)
        self.cost_model: CostModel | None = None  # fit by warm_up: without warm-up no request is refused by cost

    @property
    def kind(self) -> str | None:
        """"embedding" or "classifier" once loaded."""
        return self.description.kind if self.description is not None else None

    @property
    def dim(self) -> int:
        return self.description.dim

    # ---- start-up and shutdown (the server's loading thread) ----------------------------------------
    def _enter(self, phase: str, progress: float | None = None) -> None:
        self.phase, self.progress = phase, progress

    def start(self, draining: Callable[[], bool]) -> None:
        """Load, then (with `warmup`) warm up and calibrate: loaded. The server marks every loaded model ready (and
        itself) once all have loaded."""
        self.load()
        if self.settings.warmup and not draining():
            self.warm_up()
        self._enter("loaded")

    def load(self) -> None:
        """Load the model (fusedserve.model.load), then start its verifier and batcher and publish its kernel
        backends; the model is not warmed up yet."""
        s, spec = self.settings, self.spec
        self._enter("loading")
        log.info("loading model %s (%s) on device %s (dtype %s) ...", self.name, spec.path, s.device, s.dtype)
        self.model = load(spec.path, _load_options(s, spec))
        self.description = self.model.describe()
        self.metrics = self.server_metrics.for_model(self.name, tuple(self.description.kernels))
        self.server_metrics.model_ready.labels(self.name).set(0)
        if s.verify_sample_rate > 0:
            self.verifier = Verifier(self.model.reference_copy(), s, self.metrics, self.switches.on_mismatch)
            self.verifier.start()
        self.batcher = Batcher(self.model, s, self.metrics, on_batch=self.switches.verify if self.verifier else None)
        self.batcher.start()
        self.calibration = Calibration(self.model, self.batcher, s.max_batch_requests)
        self.switches.publish(self.description)
        self.server_metrics.watch_device_memory(self.description.device)

    def warm_up(self) -> None:
        """Before ready, each phase logged with its time: the model's own warm-up (compiles, the shape sweep, the
        first CUDA graphs) on the batcher's thread, then the fit of the cost model that admission predicts a request's
        run time with (server.cost) and the calibration of the int8/uint8 output types."""
        started = time.perf_counter()
        self.warmup_seconds.update(self.model.warm_up(self.batcher, self._enter))
        self._enter("calibration")
        # timed after the model's own warm-up: no compile or first-shape cost in the fit (server.cost)
        phase = time.perf_counter()
        s = self.settings
        self.cost_model = self.batcher.between_batches(
            lambda: cost_model(self.model, s.max_batch_tokens, s.max_batch_requests)).result()
        self.warmup_seconds["cost model"] = time.perf_counter() - phase
        log.info("cost model of %s: %s (fit in %.1fs); a request predicted to run past its deadline "
                 "(request_timeout_s=%g) is refused", self.name, self.cost_model,
                 self.warmup_seconds["cost model"], s.request_timeout_s)
        if "pooled" in self.description.outputs:  # int8/uint8 apply to one vector per input (not ColBERT's)
            phase = time.perf_counter()
            self.calibration.compute()
            self.warmup_seconds["calibration"] = time.perf_counter() - phase
        log.info("warm-up of %s done in %.1fs", self.name, time.perf_counter() - started)

    def fail(self, exc: BaseException) -> None:
        """model_load_failure=skip: this model failed to load or warm up. Logged once with its traceback, reported
        (start-up report, /readyz, /info, fusedserve_model_ready 0), its threads stopped and its memory let go."""
        self.load_error = f"{type(exc).__name__}: {exc}"
        log.error("model %s failed to load (%s); skipped (model_load_failure=skip)", self.name, self.load_error,
                  exc_info=exc)
        self._enter("failed")
        self.server_metrics.model_ready.labels(self.name).set(0)
        if self.metrics is not None:  # it loaded, then failed: no backend serves its ops any more
            self.metrics.set_backends({}, False)
        self.stop(timeout_s=1.0)
        self.model = self.batcher = self.verifier = self.calibration = None

    def stop(self, timeout_s: float) -> bool:
        """Refuse new work, answer every accepted input (within timeout_s), stop the worker, the verifier and the
        model's background work."""
        if self.model is not None:
            self.model.stop()
        drained = self.batcher.drain(timeout_s=timeout_s) if self.batcher is not None else True
        if self.verifier is not None:
            self.verifier.stop()
        return drained

    # ---- the request path (the event loop) ----------------------------------------------------------
    async def prepare(self, inputs: Sequence, options: TextOptions = TextOptions(), *,
                      deadline: Deadline | None = None) -> Rows:
        """The request's inputs (texts, text pairs or token-id rows) as the model's Rows (Preparer: short requests on
        the event loop, long ones on a thread; a 413 or 422 for what the model cannot take). deadline: the request's
        (default: from its arrival, server.deadline)."""
        self.limits.count(len(inputs))
        return await self._preparer(inputs, options, deadline, alone=not self.in_flight)

    def decode(self, rows: Sequence[Sequence[int]], skip_special_tokens: bool) -> list[str]:
        self.limits.count(len(rows))
        self.limits.token_output(sum(map(len, rows)))
        try:
            return self.model.decode(rows, skip_special_tokens)
        except InputError as exc:
            raise Unprocessable(str(exc), param=exc.param) from None

    async def run(self, rows: Rows, request: Request | None, *, normalize: bool = False,
                  dimensions: int | None = None, deadline: Deadline | None = None) -> Result:
        """The model's output rows for `rows` through the batcher, as one block: the first `dimensions` of each,
        L2-normalized where asked (quantize.shape, run by the batcher once per batch), else raw. A client that
        disconnects meanwhile cancels its inputs that have not run; past its deadline (default: request_timeout_s
        from its arrival) it is a 504, request_grace_s later where a batch holding its inputs is running. The job's
        future is the one thing awaited: the client's disconnect (the next ASGI message) and the deadline settle it
        too, so nothing polls. Without an HTTP request (gRPC) the caller's task is cancelled when its client goes."""
        deadline = deadline or Deadline.of_request(self.settings.request_timeout_s)
        left = deadline.left()
        admit(self, rows, left)
        job = self.batcher.submit(rows, left, normalize=normalize, dimensions=dimensions)
        return Result(await settled(self, job, rows, request, deadline), rows.tokens)

    async def embed(self, inputs: Sequence, options: TextOptions, request: Request | None, *, normalize: bool = False,
                    dimensions: int | None = None) -> Result:
        """prepare, then run, under one deadline."""
        deadline = Deadline.of_request(self.settings.request_timeout_s)
        return await self.run(await self.prepare(inputs, options, deadline=deadline), request, normalize=normalize,
                              dimensions=dimensions, deadline=deadline)

    async def token_rows(self, rows: Rows, request: Request | None = None, deadline: Deadline | None = None,
                         encoding: str = "float") -> list[np.ndarray]:
        """Per input, its per-token rows: the hidden states ([tokens, dim] float32, special tokens included), or a
        multi-vector model's vectors ([count, dim], model.api.multi_vector_counts); refused (413) where they would
        take more than max_response_bytes in `encoding`."""
        block = await self.output_rows(rows, "tokens", request, deadline)
        self.limits.response_bytes(block.size, encoding)
        return np.split(block, np.cumsum(multi_vector_counts(self.description, rows))[:-1])

    async def sparse_rows(self, rows: Rows, request: Request | None = None,
                          deadline: Deadline | None = None) -> list[SparseRow]:
        """Per input its sparse vector: a SPLADE model's rows from the batches, BGE-M3's from its sparse head."""
        if self.kind == "sparse":
            return sparse_of_rows((await self.run(rows, request, deadline=deadline)).rows)
        weights = await self.output_rows(rows, "sparse", request, deadline)
        return sparse_of_tokens(weights.reshape(-1), rows.ids, rows.lengths)

    async def all_outputs(self, rows: Rows, request: Request | None = None, deadline: Deadline | None = None,
                          encoding: str = "float") -> tuple[np.ndarray, list[np.ndarray], list[SparseRow]]:
        """BGE-M3's three outputs of one forward: the dense vectors (normalized), each input's multi-vectors (413
        past max_response_bytes in `encoding`) and its sparse vector."""
        block = await self.output_rows(rows, "m3", request, deadline)
        dense, vectors, weights = split_m3(block, self.description, rows)
        self.limits.response_bytes(vectors.size, encoding)
        counts = multi_vector_counts(self.description, rows)
        return (l2_normalize(dense), np.split(vectors, np.cumsum(counts)[:-1]),
                sparse_of_tokens(weights.reshape(-1), rows.ids, rows.lengths))

    async def output_rows(self, rows: Rows, output: str, request: Request | None = None,
                          deadline: Deadline | None = None) -> np.ndarray:
        """One block of `output` ("tokens": per-token rows back to back; "sparse": BGE-M3's per-token weights), as one
        forward on the batcher's thread between batches. A client that disconnects while the forward waits
        (ClientGone), or a deadline that passes (504; default: request_timeout_s from the request's arrival), has it
        skipped."""
        if output == "tokens":
            self.limits.token_output(rows.tokens)
        deadline = deadline or Deadline.of_request(self.settings.request_timeout_s)
        admit(self, rows, deadline.left())
        # a multi-vector model's per-token output is its multi-vectors (BGE-M3, ColBERT), not its hidden states
        launched = "colbert" if output == "tokens" and "colbert" in self.description.outputs else output
        block, stamps = await _between_batches(self.batcher, lambda: self.model.launch(rows, output=launched).rows(),
                                               request, deadline)
        record = CURRENT.get()
        if record is not None:
            record.served(*stamps, len(rows), rows.tokens)
        return block

    async def output(self, rows: np.ndarray, encoding: str, *, normalize: bool, dimensions: int | None = None):
        """Embeddings shaped as the request asked (run's normalize and dimensions) in the output type it asked
        for (server.quantize); the int8/uint8 ranges are calibrated on embeddings shaped the same way."""
        ranges = await self.calibration.ranges(normalize, dimensions) if encoding in QUANTIZED else None
        return encode(rows, encoding, ranges)

    # ---- reports ----------------------------------------------------------------------------------
    def startup_report(self) -> str:
        if self.load_error is not None:
            return f"model {self.name} ({self.spec.path}): FAILED to load, skipped: {self.load_error}"
        description = self.model.describe()
        named = f"serving as {self.name}: " if self.name != description.name else ""
        phases = ", ".join(f"{phase} {seconds:.1f}s" for phase, seconds in self.warmup_seconds.items())
        return f"{named}{description.report}" + (f"\nwarm-up: {phases}" if phases else "")

    def info(self) -> dict:
        """The model's entry of /info: what it is, where it runs, the memory it holds, its kernel path."""
        entry = {"model": self.name, "path": self.spec.path, "status": self.phase}
        if self.load_error is not None:
            return {**entry, "error": self.load_error}
        if self.model is None:
            return {**entry, "progress": self.progress}
        description = self.model.describe()
        memory = dict(description.memory)
        if self.verifier is not None:  # the verifier's fp32 copy lives on the same device
            memory["reference_copy_bytes"] = self.verifier.reference_bytes
        return {
            **entry,
            **state(description),
            "memory": memory,
            "batches": self.batcher.batches if self.batcher else 0,
            "overlapped": self.batcher.overlapped if self.batcher else 0,
            # int8/uint8 calibration (server.quantize): per-dimension [min, max] of normalized embeddings
            "quantization": self.calibration.info(),
        }


def admit(served: ModelService, rows: Rows, left: float) -> None:
    """A forward cannot be stopped once it runs: one predicted to outlast the `left` seconds of its deadline is
    refused (413) before it holds the worker (server.cost)."""
    if served.cost_model is None:
        return
    try:
        served.cost_model.admit(rows, left, served.settings.request_timeout_s)
    except PayloadTooLarge:
        served.metrics.rejected.labels("predicted_timeout").inc()
        raise


async def settled(served: ModelService, job, rows: Rows, request: Request | None, deadline: Deadline) -> np.ndarray:
    """The block a job submitted to `served.batcher` resolves to (run's waiting): a client that disconnects
    meanwhile cancels its inputs that have not run; past its deadline it is a 504, request_grace_s later where a batch
    holding its inputs is running."""
    left = deadline.left()
    loop = asyncio.get_running_loop()
    watcher = loop.create_task(_watch(request, job.future)) if request is not None else None
    expiry = loop.call_later(left + served.settings.request_grace_s, _settle, job.future, _Expired())
    served.in_flight += 1
    try:
        block = await job.future
    except ClientGone:
        served.batcher.cancel(job)
        raise
    except _Expired:
        served.batcher.cancel(job, "timeout")
        raise deadline.expired() from None
    except asyncio.CancelledError:
        served.batcher.cancel(job)
        raise
    finally:
        served.in_flight -= 1
        if watcher is not None:
            watcher.cancel()
        expiry.cancel()
    record = CURRENT.get()
    if record is not None and job.started is not None and job.done is not None:
        record.served(job.enqueued, job.started, job.done, len(rows), rows.tokens)
    return block


async def _between_batches(batcher: Batcher, forward: Callable[[], np.ndarray], request: Request | None,
                           deadline: Deadline) -> tuple[np.ndarray, tuple[float, float, float]]:
    """A request's `forward` on the batcher's thread between two batches, and its stamps (submitted, started, done:
    time.monotonic()). A client that disconnects while it waits (ClientGone), or a deadline that passes (504), has it
    skipped."""
    left, stamps = deadline.left(), [time.monotonic()]

    def run() -> np.ndarray:
        stamps.append(time.monotonic())
        try:
            return forward()
        finally:
            stamps.append(time.monotonic())

    loop = asyncio.get_running_loop()
    # cancelling the work's future where nobody waits for it any more cancels the batcher's, which then skips it
    work = asyncio.wrap_future(batcher.between_batches(run))
    gone = loop.create_future()
    watcher = loop.create_task(_watch(request, gone)) if request is not None else None
    try:
        await asyncio.wait((work, gone), timeout=left, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if watcher is not None:
            watcher.cancel()
        if gone.done():
            gone.exception()  # read: the disconnect is reported below, not as a never-retrieved exception
        if not work.done():
            work.cancel()
    if work.cancelled():
        raise ClientGone("client disconnected") if gone.done() else deadline.expired()
    return work.result(), tuple(stamps)


def _settle(future: asyncio.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)


async def _watch(request: Request, future: asyncio.Future) -> None:
    """Settles `future` with ClientGone when the client has gone: the request's body is read, so the next ASGI
    message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    _settle(future, ClientGone("client disconnected"))
