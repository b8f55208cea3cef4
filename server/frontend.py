"""A front-end of engines (FRONTENDS >= 1; docs/architecture.md): the routes, their limits, the tokenizing and the
answers' encoding, in a process that imports neither torch nor a model's weights. The models are the engines'
(server.engine, one per device): each engine describes them once (model.api.Description, their text side included),
their inputs are prepared here (fusedserve.model.text_side) and run there (server.engine_client), so the routes
meet the same ModelService as in a single process and cannot tell the difference.

- Start: the parent names the engines' addresses (workers.ENGINES_ENV). The front-end is ready once every engine has
  described its models, which an engine does only once its models are warm.
- An engine that goes away fails this front-end's requests in flight on it at once (503 with Retry-After), and the
  front-end answers 503 and reports not ready until an engine is back; the engine that comes back describes its
  models anew.
- The admin fused switch goes to the engines, which apply it between batches and describe the models anew to every
  front-end.
- Several engines (one per GPU) serve every model: each request goes to the connected engine with the fewest of this
  front-end's requests in flight.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import numpy as np
from starlette.requests import Request

from fusedserve.model import text_side
from fusedserve.model.api import Description, Rows, TextOptions
from fusedserve.server import wire, workers
from fusedserve.server.calibration import Calibration, embeddings_from_json
from fusedserve.server.config import ModelSpec, Settings
from fusedserve.server.deadline import Deadline
from fusedserve.server.devices import usable_cpus
from fusedserve.server.engine_client import EngineClient, RemoteJob
from fusedserve.server.errors import Unavailable
from fusedserve.server.metrics import Metrics
from fusedserve.server.model_service import ModelService, settled
from fusedserve.server.quantize import CALIBRATION_TEXTS
from fusedserve.server.service import Service, StartUp
from fusedserve.server.switches import state

log = logging.getLogger("fusedserve")

def engine_addresses() -> list[str]:
    """The engines this process fronts ([] outside a front-end)."""
    return [a for a in os.environ.get(workers.ENGINES_ENV, "").split(",") if a]


def _engine_gone() -> Unavailable:
    return Unavailable("no engine is serving: it stopped and is being started again", headers={"Retry-After": "5"})


class Engines:
    """The engines a front-end sends to, one EngineClient each, on the event loop."""

    def __init__(self, addresses: list[str]) -> None:
        self.clients = [EngineClient(a) for a in addresses]

    @property
    def connected(self) -> bool:
        return any(c.connected for c in self.clients)

    def start(self, on_description) -> None:
        for client in self.clients:
            client.on_description = on_description
            client.start()

    async def describe(self) -> dict:
        """Every engine's description once all answered (each serves every model, in the same order): the first."""
        described = await asyncio.gather(*(c.describe() for c in self.clients))
        return described[0]

    def pick(self) -> EngineClient:
        """The connected engine with the fewest of this front-end's requests in flight."""
        live = [c for c in self.clients if c.connected]
        if not live:
            raise _engine_gone()
        return min(live, key=lambda c: c.in_flight)

    def close(self) -> None:
        for client in self.clients:
            client.close()


class RemoteBatcher:
    """What ModelService's request path asks of a batcher (submit, cancel), over the engines."""

    def __init__(self, engines: Engines, index: int) -> None:
        self.engines, self.index = engines, index

    def submit(self, rows: Rows, timeout_s: float, *, normalize: bool = False, dimensions: int | None = None,
               output: str = "pooled") -> RemoteJob:
        return self.engines.pick().submit(self.index, rows, timeout_s, normalize=normalize, dimensions=dimensions,
                                          output=output)

    def cancel(self, job: RemoteJob, reason: str = "cancelled") -> None:
        job.client.cancel(job, reason)


class RemoteCalibration(Calibration):
    """The int8/uint8 ranges of a model served by engines: the calibration embeddings the engine computed at its
    warm-up, as its description carries them (adopt). Only where the engine did not warm up (WARMUP=false) are the
    calibration texts prepared here and run there, at the first request that asks for a quantized output."""

    def __init__(self, served: RemoteModel) -> None:
        super().__init__(served.model, None, served.settings.max_batch_requests)
        self.served = served

    def adopt(self, fields: dict | None) -> None:
        """The engine's calibration embeddings (Calibration.to_json; None: it has none), unless this front-end has
        its own already: the first kept, so every answer of this front-end quantizes alike."""
        if fields is not None and self.embeddings is None:
            self.embeddings = embeddings_from_json(fields)

    async def _computed(self) -> np.ndarray:
        rows = self.served.model.prepare(list(CALIBRATION_TEXTS), TextOptions())
        blocks = [(await self.served.run(rows.slice(i, min(i + self.step, len(rows))), None)).rows
                  for i in range(0, len(rows), self.step)]
        return np.concatenate(blocks).astype(np.float32)


class RemoteModel(ModelService):
    """One model of the engines: its description and text side here, its forwards there. `model` is the text side
    (prepare, decode); `batcher` the engines (RemoteBatcher)."""

    def __init__(self, settings: Settings, metrics: Metrics, name: str | None, spec: ModelSpec, index: int,
                 engines: Engines) -> None:
        super().__init__(settings, metrics, name, spec)
        self.index, self.engines = index, engines

    def attach(self, description: Description, calibrated: dict | None = None) -> None:
        """The engine's description of this model (and its calibration embeddings, `calibrated`): the first loads
        its text side here and opens its request path; a later one (after a switch, or from an engine started again)
        replaces what /info reports."""
        if self.model is None:
            if description.text is None:
                raise RuntimeError(f"model {self.name}: the engine describes no text side, so a front-end cannot "
                                   "prepare its inputs; serve it with FRONTENDS=0")
            self.model = text_side(description.text)
            self.metrics = self.server_metrics.for_model(self.name, tuple(description.kernels))
            self.batcher = RemoteBatcher(self.engines, self.index)
            self.calibration = RemoteCalibration(self)
        self.calibration.adopt(calibrated)
        self.description = description

    def stop(self, timeout_s: float) -> bool:
        return True  # nothing runs here: the engine answers what it accepted before it stops

    async def output_rows(self, rows: Rows, output: str, request: Request | None = None,
                          deadline: Deadline | None = None) -> np.ndarray:
        if output == "tokens":
            self.limits.token_output(rows.tokens)
        deadline = deadline or Deadline.of_request(self.settings.request_timeout_s)
        job = self.batcher.submit(rows, deadline.left(), output=output)
        return await settled(self, job, rows, request, deadline)

    def startup_report(self) -> str:
        named = f"serving as {self.name}: " if self.name != self.description.name else ""
        return f"{named}{self.description.report}"

    def info(self) -> dict:
        entry = {"model": self.name, "path": self.spec.path, "status": self.phase}
        if self.description is None:
            return {**entry, "progress": None}
        return {**entry, **state(self.description), "memory": dict(self.description.memory),
                "quantization": self.calibration.info()}


class FrontendStartUp(StartUp):
    """A front-end's start-up: no intra-op threads or background work of its own (the engines'), and the tokenizer's
    thread pool the CPUs shared out among the front-ends."""

    def configure_threads(self) -> None:
        frontends = max(1, int(self.service.settings.frontends))
        os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, usable_cpus() // frontends)))

    def run_background(self) -> None:
        pass


class FrontendService(Service):
    """The service of a front-end: its models are RemoteModels over the engines at `addresses`."""

    holds_models = False
    startup = FrontendStartUp

    def __init__(self, settings: Settings, addresses: list[str]) -> None:
        self.engines = Engines(addresses)
        self._loop: asyncio.AbstractEventLoop | None = None
        super().__init__(settings)

    def _model_services(self) -> list[ModelService]:
        return [RemoteModel(self.settings, self.metrics, name, spec, i, self.engines)
                for i, (name, spec) in enumerate(self.settings.served_models())]

    def info(self) -> dict:
        body = super().info()
        body["worker"].update(frontends=self.settings.frontends, engines=[c.address for c in self.engines.clients])
        return body

    def start(self):
        """On the event loop: the engines' connections first, then the start-up thread (Service.start)."""
        self._loop = asyncio.get_running_loop()
        self.engines.start(self._described)
        self._orphan_watch = self._loop.create_task(_stop_when_orphaned(os.getppid()))
        return super().start()

    def load(self) -> None:
        """The start-up thread: wait for every engine's description (an engine answers once its models are warm),
        then each model's text side."""
        for m in self.models:
            m.phase = "engine"
        self.loading = self.models[0]
        log.info("waiting for the engines at %s", ", ".join(c.address for c in self.engines.clients))
        described = asyncio.run_coroutine_threadsafe(self.engines.describe(), self._loop).result()
        self._described(described)
        log.info("the engines serve %s", self.names())

    def _described(self, described: dict) -> None:
        entries = described["models"]
        if [e["name"] for e in entries] != [m.name for m in self.models]:
            raise RuntimeError(f"the engine serves {[e['name'] for e in entries]}, this front-end was configured "
                               f"for {[m.name for m in self.models]}")
        for m, entry in zip(self.models, entries):
            m.attach(Description.from_json(entry["description"]), entry.get("calibration"))

    def check_ready(self) -> None:
        super().check_ready()
        if not self.engines.connected:
            raise _engine_gone()

    def readiness(self) -> dict:
        body = super().readiness()
        if body["status"] == "ready" and not self.engines.connected:
            return {"status": "loading", "phase": "engine", "progress": None, "reason": _engine_gone().message}
        return body

    async def set_fused(self, enabled: bool, name: str | None = None) -> list[tuple[ModelService, dict]]:
        """The admin switch, applied by every engine (one after another); the answer is the first engine's."""
        self.check_ready()
        targets = [self.model(name)] if name else self.serving
        answers = [await client.switch(enabled, targets[0].index if name else None)
                   for client in self.engines.clients]
        for answer in answers:
            if "error" in answer:
                raise wire.error_of(answer["error"])
        states = dict((n, s) for n, s in answers[0]["states"])
        return [(m, states[m.name]) for m in targets]

    def shutdown(self) -> None:
        super().shutdown()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.engines.close)


async def _stop_when_orphaned(parent: int) -> None:
    """A parent killed outright (SIGKILL, OOM) cannot stop its front-ends, and its engines stop on their own: a
    front-end left behind would answer 503 on the port forever. It drains and exits as on SIGTERM instead."""
    while os.getppid() == parent:
        await asyncio.sleep(1.0)
    log.critical("the parent process (pid %d) is gone; stopping", parent)
    os.kill(os.getpid(), signal.SIGTERM)
