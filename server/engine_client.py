"""A front-end's side of an engine (server.engine): requests go out and answers come back in one message a loop tick
each (server.wire); to the request path it looks like a model's batcher (submit -> a job whose future resolves to the
request's rows, cancel).

Requests are numbered by this client; the engine answers each (identity, number) once, and an answer settles only
the job of that number, so no request is ever answered with another's rows. A job given up on (its client left, its
deadline passed) is forgotten here at once and its cancel goes out with the next tick's message: its late answer, if
one comes, finds no job and is dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time

import zmq
import zmq.asyncio

from fusedserve.model.api import Rows
from fusedserve.server import wire
from fusedserve.server.engine import DESCRIBE, DESCRIPTION, REPLIES, REQUESTS

log = logging.getLogger("fusedserve.engine")


class RemoteJob:
    """A request sent to an engine: its future resolves to its rows [n, width] float32 or to its error; the engine's
    stamps (time.monotonic(): queued there, its first batch started, its last row delivered) once answered."""

    __slots__ = ("id", "future", "enqueued", "started", "done")

    def __init__(self, rid: int, future: asyncio.Future) -> None:
        self.id, self.future = rid, future
        self.enqueued = self.started = self.done = None


class EngineClient:
    """One engine's connection (a DEALER socket), on the event loop that uses it."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self._ids = itertools.count(1)
        self._jobs: dict[int, RemoteJob] = {}
        self._outbox: list[tuple[int, int, Rows, bool, int | None, float, bool]] = []
        self._cancels: list[int] = []
        self._flushing = False
        self._described: asyncio.Future | None = None
        self._reader: asyncio.Task | None = None

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def start(self) -> None:
        """Start reading answers (on the running loop)."""
        self._reader = asyncio.get_running_loop().create_task(self._read(), name=f"engine-client[{self.address}]")

    async def describe(self) -> dict:
        """The engine's models (server.engine.describe)."""
        self._described = asyncio.get_running_loop().create_future()
        await self._socket.send_multipart([DESCRIBE])
        return await self._described

    def submit(self, model: int, rows: Rows, timeout_s: float, *, normalize: bool = False,
               dimensions: int | None = None, tokens: bool = False) -> RemoteJob:
        """Queue a request for this tick's message; its job's future resolves as Batcher.submit's does, or with
        tokens=True to every token's row [rows.tokens, width] (ModelService.token_rows' blocks, back to back)."""
        loop = asyncio.get_running_loop()
        job = RemoteJob(next(self._ids), loop.create_future())
        self._jobs[job.id] = job
        self._outbox.append((job.id, model, rows, normalize, dimensions, time.monotonic() + timeout_s, tokens))
        self._schedule(loop)
        return job

    def cancel(self, job: RemoteJob, reason: str = "cancelled") -> None:
        """Give up on a job: forgotten now, its cancel in this tick's message (the engine drops its inputs that have
        not run)."""
        if self._jobs.pop(job.id, None) is not None:
            self._cancels.append(job.id)
            self._schedule(asyncio.get_running_loop())

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._socket.close(linger=0)

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._flushing:
            self._flushing = True
            loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Once per tick: every request and cancel of the tick in one message."""
        self._flushing = False
        outbox, cancels, self._outbox, self._cancels = self._outbox, self._cancels, [], []
        self._socket.send_multipart([REQUESTS, *wire.pack_requests(outbox, cancels)], copy=False)

    async def _read(self) -> None:
        while True:
            frames = await self._socket.recv_multipart(copy=False)
            kind = frames[0].bytes
            if kind == DESCRIPTION:
                if self._described is not None and not self._described.done():
                    self._described.set_result(json.loads(frames[1].bytes))
                continue
            if kind != REPLIES:
                log.warning("engine %s sent a message of unknown kind %r", self.address, kind[:32])
                continue
            for answer in wire.unpack_replies([f.buffer for f in frames[1:]]):
                job = self._jobs.pop(answer.id, None)
                if job is None or job.future.done():
                    continue  # given up on
                job.enqueued, job.started, job.done = answer.enqueued, answer.started, answer.done
                if answer.error is not None:
                    job.future.set_exception(answer.error)
                else:
                    job.future.set_result(answer.rows)
