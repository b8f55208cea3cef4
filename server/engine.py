"""The engine: the one process of a device that owns its models (their kernel selection, CUDA graphs and batchers),
fed by front-end processes that do the HTTP work, the tokenizing and the answers' encoding (docs/architecture.md).

Front-ends connect to the engine's ROUTER socket (a DEALER each, server.engine_client). Each sends, once per loop
tick, every request it prepared meanwhile as one message (server.wire); the engine submits each request to its
model's batcher, so requests of every front-end share the batches, and sends each front-end, once per tick, every
answer completed meanwhile. A request is known by its front-end's identity and its id there: an answer can only go
to the request that asked. A front-end that goes away leaves answers for no one, and ZeroMQ drops them.

The admin fused switch comes the same way (SWITCH): the engine applies it between batches and sends every front-end
it knows the models described anew, so each one's /info and answers follow.

The engine checks what the front-end cannot: the request's model exists here, its deadline has not passed, its
predicted run time fits the deadline (the cost model of the warm-up), and the queue has room; each refusal is the
answer's error, with the status the front-end answers its client with.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import time
from collections.abc import Sequence

import zmq
import zmq.asyncio

from fusedserve.server import wire
from fusedserve.server.batcher import Job
from fusedserve.server.deadline import Deadline, not_served
from fusedserve.server.errors import NotFound, ServiceError
from fusedserve.server.model_service import ModelService, admit

log = logging.getLogger("fusedserve.engine")

# a message's first frame says what it holds
REQUESTS, REPLIES, DESCRIBE, DESCRIPTION = b"requests", b"replies", b"describe", b"description"
SWITCH, SWITCHED = b"switch", b"switched"


def describe(models: Sequence[ModelService]) -> dict:
    """What a front-end needs of each model, in the engine's order (a request names its model by index): the name
    clients call it by, its Description (model.api), whose `text` lets the front-end prepare inputs itself, and the
    int8/uint8 calibration embeddings of its warm-up (server.calibration; None without warm-up), which the front-end
    quantizes with instead of running the calibration texts through the engine again."""
    return {"models": [{"name": m.name, "description": m.description.to_json(),
                        "calibration": m.calibration.to_json() if m.calibration is not None else None}
                       for m in models]}


def _answerable(error: BaseException | None, identity: bytes, rid: int) -> ServiceError | None:
    """A request's failure as its answer: a ServiceError as it is, anything else logged and a 500 naming its type
    (as the batcher fails a batch)."""
    if error is None or isinstance(error, ServiceError):
        return error
    log.error("request %d of %s failed: %s: %s", rid, identity.hex(), type(error).__name__, error)
    return ServiceError(f"inference failed ({type(error).__name__})")


class Engine:
    """The engine's socket and the requests in flight: (front-end identity, request id) -> the batcher and its job."""

    def __init__(self, models: Sequence[ModelService], address: str) -> None:
        self.models, self.address = list(models), address
        self._socket: zmq.asyncio.Socket | None = None
        # a per-token request is a task awaiting the model's forward between batches, not a batcher job
        self._jobs: dict[tuple[bytes, int], tuple[ModelService, Job | asyncio.Task]] = {}
        self._outbox: dict[bytes, list[wire.Answer]] = {}
        self._flushing = False
        self._front_ends: set[bytes] = set()  # every identity heard from: told of each switch
        self.malformed = 0  # messages that were not a front-end's (logged, dropped)

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    async def serve(self, bound: asyncio.Event | None = None) -> None:
        """Answer front-ends until cancelled."""
        self._socket = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(self.address)
        if bound is not None:
            bound.set()
        try:
            while True:
                frames = await self._socket.recv_multipart(copy=False)
                if len(frames) < 2:
                    self._malformed(frames[0].bytes, "no kind frame")
                    continue
                identity, kind, body = frames[0].bytes, frames[1].bytes, [f.buffer for f in frames[2:]]
                if kind == REQUESTS:
                    self._requests(identity, body)
                elif kind == DESCRIBE:
                    self._front_ends.add(identity)
                    body = json.dumps(describe(self.models)).encode()
                    await self._socket.send_multipart([identity, DESCRIPTION, body])
                elif kind == SWITCH:
                    self._front_ends.add(identity)
                    asyncio.get_running_loop().create_task(self._switch(identity, bytes(body[0]) if body else b""))
                else:
                    self._malformed(identity, f"unknown kind {kind[:32]!r}")
        finally:
            self._socket.close(linger=0)

    async def _switch(self, identity: bytes, body: bytes) -> None:
        """The admin switch on one model or every model, one after another (their selections share the Triton
        autotuners); answered with each switched model's state, or the error; then every front-end is sent the
        models described anew."""
        try:
            asked = json.loads(body)
            ticket, enabled, index = asked["ticket"], bool(asked["enabled"]), asked["model"]
        except (ValueError, KeyError, TypeError) as exc:
            self._malformed(identity, f"switch: {exc}")
            return
        targets = self.models if index is None else self.models[index:index + 1]
        try:
            states = [await asyncio.to_thread(m.switches.set_fused, enabled) for m in targets]
            answer = {"ticket": ticket, "states": [[m.name, s] for m, s in zip(targets, states)]}
        except Exception as exc:
            error = _answerable(exc, identity, ticket)
            answer = {"ticket": ticket, "error": wire.error_fields(error)}
        await self._socket.send_multipart([identity, SWITCHED, json.dumps(answer).encode()])
        described = json.dumps(describe(self.models)).encode()
        for front_end in self._front_ends:
            await self._socket.send_multipart([front_end, DESCRIPTION, described])

    def _malformed(self, identity: bytes, why: str) -> None:
        self.malformed += 1
        log.warning("dropped a message from %s: %s", identity.hex(), why)

    def _requests(self, identity: bytes, frames: list) -> None:
        try:
            submits, cancels = wire.unpack_requests(frames)
        except ValueError as exc:
            self._malformed(identity, str(exc))
            return
        for rid in cancels.tolist():
            entry = self._jobs.pop((identity, rid), None)
            if entry is None:
                continue
            served, work = entry
            if isinstance(work, asyncio.Task):
                work.cancel()
            else:
                served.batcher.cancel(work)
        now = time.monotonic()
        for s in submits:
            try:
                if s.model >= len(self.models):
                    raise NotFound(f"model index {s.model}: this engine serves {len(self.models)} models")
                served, left = self.models[s.model], s.deadline - now
                if left <= 0:
                    raise not_served(served.settings.request_timeout_s)
                if s.output == "pooled":  # output_rows checks and admits its own (its refusal is the task's answer)
                    admit(served, s.rows, left)
                    job = served.batcher.submit(s.rows, left, normalize=s.normalize, dimensions=s.dimensions)
            except ServiceError as exc:
                self._answer(identity, wire.Answer(s.id, None, exc, None, None, None))
                continue
            if s.output != "pooled":
                deadline = Deadline(s.deadline, served.settings.request_timeout_s)
                task = asyncio.get_running_loop().create_task(served.output_rows(s.rows, s.output, deadline=deadline))
                self._jobs[(identity, s.id)] = (served, task)
                task.add_done_callback(functools.partial(self._tokens_done, identity, s.id))
                continue
            self._jobs[(identity, s.id)] = (served, job)
            job.future.add_done_callback(functools.partial(self._done, identity, s.id, job))

    def _done(self, identity: bytes, rid: int, job: Job, future: asyncio.Future) -> None:
        if self._jobs.pop((identity, rid), None) is None or future.cancelled():
            return  # cancelled by its front-end: nobody waits for it
        error = _answerable(future.exception(), identity, rid)
        self._answer(identity, wire.Answer(rid, None if error else future.result(), error, job.enqueued or None,
                                           job.started, job.done))

    def _tokens_done(self, identity: bytes, rid: int, task: asyncio.Task) -> None:
        if self._jobs.pop((identity, rid), None) is None or task.cancelled():
            return
        error = _answerable(task.exception(), identity, rid)
        rows = None if error else task.result()
        self._answer(identity, wire.Answer(rid, rows, error, None, None, None))

    def _answer(self, identity: bytes, answer: wire.Answer) -> None:
        self._outbox.setdefault(identity, []).append(answer)
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Once per tick: each front-end's answers in one message."""
        self._flushing = False
        outbox, self._outbox = self._outbox, {}
        for identity, answers in outbox.items():
            self._socket.send_multipart([identity, REPLIES, *wire.pack_replies(answers)], copy=False)


def main(argv: list[str] | None = None) -> None:
    """`python -m fusedserve.server.engine --address ipc:///path`: the models of the FUSEDSERVE_* settings loaded and
    warmed up on their device, then served to front-ends at the address until the process is stopped."""
    import argparse
    import signal

    from fusedserve.model import host
    from fusedserve.server import devices, workers
    from fusedserve.server.switches import refreeze
    from fusedserve.server.config import Settings
    from fusedserve.server.heap import fix_malloc_thresholds
    from fusedserve.server.metrics import Metrics

    parser = argparse.ArgumentParser(prog="python -m fusedserve.server.engine")
    parser.add_argument("--address", required=True, help="the ZeroMQ endpoint front-ends connect to")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    from fusedserve.server.observability import configure_logging

    fix_malloc_thresholds()  # before the model allocates, as in a single-process server (server.heap)
    settings = Settings()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    configure_logging(args.log_level, settings.log_format)
    device = workers.device_name(devices.devices(settings.device)[0])
    if settings.torch_threads:
        host.set_threads(settings.torch_threads)
    metrics = Metrics(device)
    models = [ModelService(settings, metrics, name, spec) for name, spec in settings.served_models()]
    started = time.monotonic()
    for served in models:
        served.start(lambda: False)
        metrics.model_ready.labels(served.name).set(1)
    refreeze()
    log.info("engine on %s ready in %.1fs, at %s:\n%s", device, time.monotonic() - started, args.address,
             "\n".join(m.startup_report() for m in models))

    async def serve() -> None:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        bound = asyncio.Event()
        serving = loop.create_task(Engine(models, args.address).serve(bound))
        await bound.wait()
        directory = workers.state_dir()
        if directory is not None:  # the parent's view: this engine was ready once (a later exit is restarted)
            (directory / f"engine-ready-{os.getpid()}").touch()
        for served in models:  # the models' own background work (the rest of their CUDA graphs)
            served.model.run_background(served.batcher)
        parent = os.getppid()

        async def orphaned() -> None:
            # a parent killed outright (SIGKILL, OOM) cannot stop its engines: one left behind would hold the GPU
            while os.getppid() == parent:
                await asyncio.sleep(1.0)
            log.critical("the parent process (pid %d) is gone; stopping", parent)
            task.cancel()

        watcher = loop.create_task(orphaned())
        try:
            await serving
        except asyncio.CancelledError:
            serving.cancel()
        finally:
            watcher.cancel()

    try:
        asyncio.run(serve())
    finally:
        for served in models:
            served.stop(timeout_s=settings.request_timeout_s)
        log.warning("engine on %s stopped", device)


if __name__ == "__main__":
    main()
