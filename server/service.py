"""The server the routes share: its models (one server.model_service.ModelService each: a ServedModel on the shared
device, a batcher, a verifier), which of them a request means, the start-up (the models load and warm up one after
another on a thread of their own, so the port answers from the start), readiness (its one owner: a request is
checked once, when its model is looked up), /info and the drain on shutdown."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path


from fusedserve.model import host
from fusedserve.server import devices, workers
from fusedserve.server.config import Settings
from fusedserve.server.errors import NotFound, Unavailable, Unprocessable, quoted
from fusedserve.server.metrics import Metrics
from fusedserve.server.model_service import ModelService
from fusedserve.server.observability import CURRENT
from fusedserve.server.switches import refreeze

log = logging.getLogger("fusedserve")

from fusedserve import __version__ as VERSION  # the version is written once, in fusedserve/__init__.py


def _process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc), for the start-up report's share before the service
    existed; None elsewhere."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: start time
        age = float(Path("/proc/uptime").read_text().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    # a container whose /proc/uptime is its own while the start time counts from the host's boot: no answer
    return age if 0 <= age < time.monotonic() + 1 else None


def _serves(model: ModelService, kind: str) -> bool:
    """Whether a route of `kind` can serve the model: its own kind, or sparse vectors or multi-vectors from a model
    that gives them (BGE-M3, ColBERT: Description.outputs), or a re-rank ("reranker": a classifier or a
    late-interaction model)."""
    outputs = model.description.outputs if model.description is not None else ()
    if kind == "reranker":  # a cross-encoder, or a late-interaction model scoring by MaxSim
        return model.kind == "classifier" or "colbert" in outputs
    if kind == "embedding" and outputs and "pooled" not in outputs:  # a ColBERT model: multi-vectors only
        return False
    if kind == "tokens":  # per-token rows (/embed_all): every embedding model's
        return model.kind == "embedding"
    return model.kind == kind or kind == "sparse" and "sparse" in outputs or kind == "multi_vector" and \
        "colbert" in outputs


class SharedSwitch:
    """WORKERS > 1: the admin fused switch through the workers' shared state (server.workers): the worker a request
    reaches publishes it and applies it, every other worker's follower applies each new generation."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.applied = 0  # the latest generation of the admin switch this worker applied

    async def apply(self, switch: dict) -> list[tuple[ModelService, dict]]:
        """Apply a switch from the shared state and acknowledge it; the one place that moves `applied`."""
        self.applied = switch["generation"]  # before the await: the follower must not take it up again
        switched = await self.service.set_fused(switch["enabled"], switch["model"])
        workers.acknowledge_switch(switch["generation"])
        return switched

    async def follow(self) -> None:
        """Apply each new admin switch another worker published, once ready."""
        while True:
            await asyncio.sleep(workers.SWITCH_POLL_S)
            switch = workers.read_switch()
            if switch is None or switch["generation"] <= self.applied or not self.service.ready:
                continue
            try:
                await self.apply(switch)
            except Exception:  # logged; the worker keeps its path, and the admin's answer says who did not switch
                log.exception("applying the admin switch of another worker failed")
                continue
            log.warning("admin switch from another worker applied: fused %s (%s)", switch["enabled"],
                        switch["model"] or "every model")


class StartUp:
    """The start-up's thread (Service.start): the threads' share of the CPUs, then every model loaded and warmed up
    (Service.load), the start's objects frozen, the start-up report logged and the server ready. A failure is
    recorded for /readyz and stops the process (Service.on_fatal)."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def run(self) -> None:
        service = self.service
        try:
            self.configure_threads()
            service.phase = "loading"
            service.load()
            if not service.draining:
                # What the start made (modules, weights' Python objects, compiled kernels, graphs) lives as long as
                # the process: frozen out of the collector's sight, a later full collection walks only what requests
                # leave behind instead of pausing a request to walk the start's objects too
                refreeze()
                # the report is written before readiness flips, so whoever sees the server ready finds it in the log
                elapsed, age = time.monotonic() - service._started, _process_age_s()
                before = f" ({age - elapsed:.1f}s earlier the process started: interpreter, imports, settings)" \
                    if age is not None else ""
                try:
                    log.info("ready in %.1fs%s\n%s", elapsed, before, self.report())
                except Exception:  # the report is for reading: a bug in it must not stop a server that is ready
                    log.exception("ready in %.1fs; the start-up report failed", elapsed)
                service.mark_ready()
                self.run_background()
        except BaseException as exc:
            failing = service.loading
            named = f"model {failing.name!r} ({failing.spec.path}): " if failing is not None else ""
            service.load_error = f"{named}{type(exc).__name__}: {exc}"
            log.critical("start-up failed while %s; stopping", f"{failing.phase} {failing.name}" if failing else
                         service.phase, exc_info=True)
            service.phase = "failed"
            if failing is not None:
                failing.phase = "failed"
            if service.on_fatal is not None:
                service.on_fatal()

    def configure_threads(self) -> None:
        """Before any model loads: the intra-op threads and the tokenizer's, each worker its share of the CPUs; on a
        GPU, workers after the first wait for it to fill the kernel cache."""
        settings = self.service.settings
        threads = settings.torch_threads or workers.threads_per_worker(settings.workers)
        if threads:
            host.set_threads(threads)
            # the tokenizer's thread pool (rayon's, sized at its first parallel batch, after this) gets the same
            # share: a pool per worker as wide as the machine spins the other workers' cores for small batches
            os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
        if host.on_gpu(settings.device):
            workers.wait_for_the_first()  # on the CPU nothing is compiled or raced: the workers load together

    def run_background(self) -> None:
        """Once ready: the models' own background work (the rest of their CUDA graphs)."""
        for m in self.service.serving:
            if m.model is not None:
                m.model.run_background(m.batcher)

    def report(self) -> str:
        s = self.service.settings
        models = "\n".join(m.startup_report() for m in self.service.models)
        return (f"{models}\n"
                f"batching: max_batch_tokens {s.max_batch_tokens}, max_batch_requests "
                f"{s.max_batch_requests}, max_wait_ms {s.max_wait_ms:g}, max_queue {s.max_queue}; "
                f"verify_sample_rate {s.verify_sample_rate:g} ({s.verify_action}), "
                f"kernel_timing_sample_rate {s.kernel_timing_sample_rate:g}")


class Service:
    # the models run in this process (False: a front-end of engines, server.frontend)
    holds_models = True
    startup = StartUp  # the start-up's thread

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # a worker's or a front-end's (named by its parent), or the one device
        self.device = workers.device_name(None) or devices.devices(settings.device)[0]
        self.metrics = Metrics(self.device, holds_device=self.holds_models)
        # set once each (loaded, then draining) and read from the event loop, the signal handler and the drain
        # timer: Events, so no reader depends on when another thread's write becomes visible
        self._ready = threading.Event()
        self._draining = threading.Event()
        # in configuration order: the first is the default model
        self.models = self._model_services()
        self.loading: ModelService | None = None  # the model the start-up is working on
        self.phase = "starting"  # the server's: starting, loading (a model's phase then), ready or failed
        self.load_error: str | None = None  # why the start failed
        self.on_fatal: Callable[[], None] | None = None  # fusedserve serve: stop the process when loading fails
        self.created = int(time.time())
        self._started = time.monotonic()
        self.tracing = None
        if settings.otlp_endpoint:
            from fusedserve.server.tracing import Tracing

            self.tracing = Tracing(settings.otlp_endpoint, settings.otel_service_name, VERSION)
        if self.holds_models:
            self.metrics.watch_cuda_graphs(
                lambda: [(m.name, dict(m.model.describe().graphs)) for m in self.models if m.model is not None])
        self.shared_switch = SharedSwitch(self)

    def _model_services(self) -> list[ModelService]:
        return [ModelService(self.settings, self.metrics, name, spec) for name, spec in self.settings.served_models()]

    @property
    def follows_switch(self) -> bool:
        """WORKERS > 1: the admin switch reaches the other workers through their shared state (SharedSwitch;
        front-ends of engines send it to the engines instead)."""
        return workers.state_dir() is not None and self.holds_models

    # ---- which model a request means ------------------------------------------------------------
    @property
    def serving(self) -> list[ModelService]:
        """The models that loaded (with model_load_failure=skip, a failed one is left out)."""
        return [m for m in self.models if m.load_error is None]

    @property
    def default(self) -> ModelService:
        """The first model of the configuration."""
        return self.models[0]

    def model(self, name: str | None = None, kind: str | None = None) -> ModelService:
        """The model a request names; without a name (None or ""), the first model of the configuration that serves
        `kind` ("embedding", "classifier"; None: the first model). A model that failed to load and comes before that
        one answers 503 rather than the request silently going to another model. An unknown name is a 404 naming the
        models served; a model of the wrong kind for the route a 422. The request's metrics and span carry the
        model's name from here on. The one readiness check of a request."""
        self.check_ready()
        if name:
            chosen = next((m for m in self.models if m.name == name), None)
            if chosen is None:
                raise NotFound(f"model {quoted(name)} is not served here; this server serves {self.names()}",
                               param="model", code="model_not_found")
        else:
            chosen = self._first_of(kind)
        if chosen.load_error is not None:
            raise Unavailable(f"model {chosen.name!r} failed to load ({chosen.load_error})")
        if kind == "embedding" and chosen.kind == "embedding" and not _serves(chosen, kind):
            raise Unprocessable(f"{chosen.name} gives multi-vectors only (a ColBERT model): /embed_all, /v1/embeddings "
                                f"with output multi_vector, /rerank or /v1/rerank")
        if kind == "multi_vector" and not _serves(chosen, kind):
            raise Unprocessable(f"{chosen.name} gives no multi-vectors (a BGE-M3 or ColBERT model does); its "
                                f"per-token hidden states are on /embed_all", param="output")
        if kind is not None and not _serves(chosen, kind):
            served = chosen.kind
            use = {"classifier": "/rerank, /v1/rerank or /predict",
                   "sparse": "/embed_sparse, or /v1/embeddings with encoding_format sparse"}.get(
                       served, "/infer, /embed or /v1/embeddings")
            kind = {"tokens": "embedding", "reranker": "re-ranking"}.get(kind, kind)
            raise Unprocessable(f"this route serves {kind} models; {chosen.name} is a{'n' * (served[0] in 'ae')} "
                                f"{served} model: use {use}")
        record = CURRENT.get()
        if record is not None:
            record.model = chosen.name
        return chosen

    def _first_of(self, kind: str | None) -> ModelService:
        for m in self.models:
            if m.load_error is not None:
                raise Unavailable(f"model {m.name!r} failed to load ({m.load_error}), and a request without a model "
                                  f"name may have meant it: name one of {self.names()}", param="model")
            if kind is None or _serves(m, kind):
                return m
        return self.default  # none serves this kind: the kind check answers, naming what it serves

    def names(self) -> str:
        return ", ".join(repr(m.name) for m in self.serving)

    # ---- lifecycle --------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def mark_ready(self) -> None:
        for m in self.serving:
            m.phase, m.progress = "ready", None
            self.metrics.model_ready.labels(m.name).set(1)
        self.phase = "ready"
        self._ready.set()
        workers.mark_ready()

    def start_draining(self) -> None:
        """Readiness and new requests answer 503 from now on (safe from a signal handler or a timer)."""
        self._draining.set()

    def check_probe(self) -> None:
        """A readiness probe's check (KServe's, TEI's): check_ready, and with WORKERS > 1 every worker ready."""
        self.check_ready()
        if not workers.all_ready():
            raise Unavailable("still loading: not every worker is ready", headers={"Retry-After": "5"})

    def check_ready(self) -> None:
        if self.draining:
            raise Unavailable("the server is shutting down", headers={"Retry-After": "1"})
        if not self.ready:
            if self.load_error is not None:
                raise Unavailable(f"the model failed to load ({self.load_error})")
            m = self.loading
            if m is None:
                raise Unavailable("the model is still loading (starting)", headers={"Retry-After": "5"})
            progress = f", {m.progress:.0%}" if m.progress is not None else ""
            raise Unavailable(f"still loading model {m.name} ({m.phase}{progress})", headers={"Retry-After": "5"})

    def start(self) -> threading.Thread:
        """Load and warm up every model on a thread of its own, then ready; the event loop serves meanwhile (the
        probes, and 503 with the phase everywhere else). A failure is logged with its traceback, /readyz reports
        it, and on_fatal (set by `fusedserve serve`) stops the process; with model_load_failure=skip a model's
        failure is reported and the others serve. A daemon thread: a SIGTERM during the load ends the process
        without waiting for it."""
        thread = threading.Thread(target=self.startup(self).run, name="fusedserve-load", daemon=True)
        thread.start()
        return thread

    def load(self) -> None:
        """Each model in turn: load, warm up (with `warmup`), ready. The models share the device, and one load at a
        time keeps the kernel self-tests and races of one from timing the other's work."""
        for m in self.models:
            if self.draining:
                return
            m.phase = "loading"  # before it is the one /readyz reports: phases only move forward there
            self.loading = m
            try:
                m.start(lambda: self.draining)
            except Exception as exc:
                if self.settings.model_load_failure != "skip":
                    raise
                m.fail(exc)
        if not self.serving:
            raise RuntimeError("no model loaded: " + "; ".join(f"{m.name}: {m.load_error}" for m in self.models))

    def readiness(self) -> dict:
        """/readyz's body: ready (with the models that failed to load, if any were skipped), draining, failed, or
        loading with the model, its phase and its progress (0..1 where known)."""
        if self.draining:
            return {"status": "draining"}
        if self.ready and not workers.all_ready():  # WORKERS > 1: a probe must not see a worker still loading
            return {"status": "loading", "phase": "workers", "progress": None,
                    "elapsed_s": round(time.monotonic() - self._started, 1)}
        if self.ready:
            failed = {m.name: m.load_error for m in self.models if m.load_error is not None}
            return {"status": "ready", **({"failed": failed} if failed else {})}
        if self.load_error is not None:
            return {"status": "failed", "phase": self.phase, "reason": self.load_error}
        m = self.loading
        return {"status": "loading", "phase": m.phase if m is not None else self.phase,
                "progress": m.progress if m is not None else None,
                **({"model": m.name} if m is not None else {}),
                "elapsed_s": round(time.monotonic() - self._started, 1)}

    def shutdown(self) -> None:
        """Refuse new work, answer what every model accepted (within request_timeout_s in all), stop."""
        self.start_draining()
        deadline = time.monotonic() + self.settings.request_timeout_s
        stopped = [m.stop(timeout_s=max(deadline - time.monotonic(), 0.1)) for m in self.models]  # every one
        drained = all(stopped)
        log.warning("batcher drained: %s", "all accepted requests answered" if drained else "timed out")
        if self.tracing:
            self.tracing.shutdown()

    # ---- runtime switches and reports ------------------------------------------------------------------
    async def set_fused(self, enabled: bool, name: str | None = None) -> list[tuple[ModelService, dict]]:
        """The admin switch on the named model, or on every model, one model after another: selecting kernels runs
        their self-tests through the Triton autotuners, which keep per-call state on themselves and are shared by
        every model in the process."""
        self.check_ready()
        targets = [self.model(name)] if name else self.serving
        states = [await asyncio.to_thread(m.switches.set_fused, enabled) for m in targets]
        return list(zip(targets, states))

    def info(self) -> dict:
        """/info: the first model's entry (the first that loaded) at the top level, what a one-model server always
        showed; the server's state and limits; and `models`, every model's entry (kind, dim or labels, memory,
        kernel path)."""
        s = self.settings
        entries = [m.info() for m in self.models]
        first = next((e for m, e in zip(self.models, entries) if m.load_error is None), entries[0])
        return {
            "model": None, "dim": None, "max_seq_length": None, "device": None, "dtype": None, "fused": False,
            "fallback": None, "kernels": {}, "quantization": None,  # until the model has loaded
            **{k: v for k, v in first.items() if k not in ("status", "path", "batches", "overlapped")},
            "ready": self.ready,
            "phase": "ready" if self.ready else (self.loading.phase if self.loading is not None else self.phase),
            "batching": {"max_batch_tokens": s.max_batch_tokens, "max_batch_requests": s.max_batch_requests,
                         "max_wait_ms": s.max_wait_ms, "max_queue": s.max_queue,
                         "max_client_batch": s.max_client_batch, "request_timeout_s": s.request_timeout_s,
                         "overlap_batches": s.overlap_batches,
                         "batches": sum(e.get("batches", 0) for e in entries),
                         "overlapped": sum(e.get("overlapped", 0) for e in entries)},
            "verify": {"sample_rate": s.verify_sample_rate, "action": s.verify_action,
                       "tolerance": s.verify_tolerance},
            "model_load_failure": s.model_load_failure,
            # the process that answered, of how many, and its threads (intra-op; the tokenizer's, where sized)
            "worker": {"pid": os.getpid(), "workers": s.workers, "device": self.device,
                       "index": int(os.environ.get(workers.INDEX_ENV, "0")),
                       "torch_threads": host.threads() if self.holds_models else None,
                       "tokenizer_threads": int(os.environ.get("RAYON_NUM_THREADS", "0")) or None},
            "models": entries,
        }
