"""A front-end's side of an engine (server.engine): requests go out and answers come back in one message a loop tick
each (server.wire); to the request path it looks like a model's batcher (submit -> a job whose future resolves to the
request's rows, cancel).

Requests are numbered by this client; the engine answers each (identity, number) once, and an answer settles only
the job of that number, so no request is ever answered with another's rows. A job given up on (its client left, its
deadline passed) is forgotten here at once and its cancel goes out with the next tick's message: its late answer, if
one comes, finds no job and is dropped.

The connection is watched (ZeroMQ's socket monitor): when the engine goes away every job in flight fails at once
with a 503 and Retry-After (no client waits for its deadline), and `connected` is false until an engine listens at
the address again (the engine binds only once its models are ready). `connected` has two sources, the monitor and
the engine's DESCRIPTION messages, which race; EngineClient._set_connected, the one place it changes, says the rule.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from fusedserve.model.api import Rows
from fusedserve.server import wire
from fusedserve.server.engine import DESCRIBE, DESCRIPTION, REPLIES, REQUESTS, SWITCH, SWITCHED
from fusedserve.server.errors import Unavailable

log = logging.getLogger("fusedserve.engine")


class RemoteJob:
    """A request sent to an engine: its future resolves to its rows [n, width] float32 or to its error; the engine's
    stamps (time.monotonic(): queued there, its first batch started, its last row delivered) once answered."""

    __slots__ = ("id", "future", "client", "enqueued", "started", "done")

    def __init__(self, rid: int, future: asyncio.Future, client: EngineClient) -> None:
        self.id, self.future, self.client = rid, future, client
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
        self._switched: dict[int, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self._connected = False  # written by _set_connected only
        self.on_description = None  # called with each description the engine sends unasked (after a switch)
        self.disconnects = 0

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    @property
    def connected(self) -> bool:
        """An engine listens at the address and the connection stands."""
        return self._connected

    def start(self) -> None:
        """Start reading answers and watching the connection (on the running loop)."""
        loop = asyncio.get_running_loop()
        events = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        monitor = self._socket.get_monitor_socket(events)
        self._tasks = [loop.create_task(self._read(), name=f"engine-client[{self.address}]"),
                       loop.create_task(self._watch(monitor), name=f"engine-monitor[{self.address}]")]

    async def describe(self) -> dict:
        """The engine's models (server.engine.describe); waits for an engine to listen."""
        if self._described is None or self._described.done():
            self._described = asyncio.get_running_loop().create_future()
            await self._socket.send_multipart([DESCRIBE])
        return await asyncio.shield(self._described)

    async def switch(self, enabled: bool, model: int | None) -> dict:
        """The admin fused switch, applied by the engine (model: an index, None: every model): the engine's answer,
        {"models": [...described anew...]} or {"error": status, "message"}."""
        ticket = next(self._ids)
        future = self._switched[ticket] = asyncio.get_running_loop().create_future()
        body = json.dumps({"ticket": ticket, "enabled": enabled, "model": model}).encode()
        await self._socket.send_multipart([SWITCH, body])
        try:
            return await future
        finally:
            self._switched.pop(ticket, None)

    def submit(self, model: int, rows: Rows, timeout_s: float, *, normalize: bool = False,
               dimensions: int | None = None, output: str = "pooled") -> RemoteJob:
        """Queue a request for this tick's message; its job's future resolves as Batcher.submit's does, or, for another
        `output` ("tokens", "sparse"), to ModelService.output_rows' block."""
        loop = asyncio.get_running_loop()
        job = RemoteJob(next(self._ids), loop.create_future(), self)
        self._jobs[job.id] = job
        self._outbox.append((job.id, model, rows, normalize, dimensions, time.monotonic() + timeout_s, output))
        self._schedule(loop)
        return job

    def cancel(self, job: RemoteJob, reason: str = "cancelled") -> None:
        """Give up on a job: forgotten now, its cancel in this tick's message (the engine drops its inputs that have
        not run)."""
        if self._jobs.pop(job.id, None) is not None:
            self._cancels.append(job.id)
            self._schedule(asyncio.get_running_loop())

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._socket.disable_monitor()
        self._socket.close(linger=0)

    def _set_connected(self, standing: bool) -> None:
        """The one place `connected` changes, from its two sources: the socket monitor (a handshake: True, a
        disconnect: False) and a DESCRIPTION message (True: an engine that answers stands on the connection). They
        race, since the monitor's events come on a socket of their own: the handshake event may come after the
        description that the handshake made possible. So the rule is that of a latch, whatever the order: True from
        the first of the two to come (a later True changes nothing), False only on a disconnect of a standing
        connection, which fails its jobs in flight once (a disconnect while not connected is not a second loss)."""
        if standing == self._connected:
            return
        self._connected = standing
        if not standing:
            self._lost()

    def _lost(self) -> None:
        """The engine went away: every job in flight fails now (the engine that comes back knows none of them)."""
        self.disconnects += 1
        jobs, self._jobs = self._jobs, {}
        gone = Unavailable("the engine serving this model stopped; it is being started again",
                           headers={"Retry-After": "5"})
        for job in jobs.values():
            if not job.future.done():
                job.future.set_exception(gone)
        for future in self._switched.values():  # a describe waits on: the next engine answers it
            if not future.done():
                future.set_exception(gone)
        if jobs:
            log.error("engine %s went away: %d requests in flight failed (503)", self.address, len(jobs))

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                await self._on_event(parse_monitor_message(await monitor.recv_multipart())["event"])
        finally:
            monitor.close(linger=0)

    async def _on_event(self, event: int) -> None:
        """One event of the socket monitor."""
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._set_connected(True)
            if self.disconnects:  # a new engine: described anew (a describe waiting is answered by it)
                await self._socket.send_multipart([DESCRIBE])
        elif event == zmq.EVENT_DISCONNECTED:
            self._set_connected(False)

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
            self._on_message(await self._socket.recv_multipart(copy=False))

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        """One message of the engine."""
        kind = frames[0].bytes
        if kind == DESCRIPTION:
            self._set_connected(True)  # the engine answers on a connection that stands (_set_connected's rule)
            described = json.loads(frames[1].bytes)
            if self._described is not None and not self._described.done():
                self._described.set_result(described)
            elif self.on_description is not None:
                self.on_description(described)
            return
        if kind == SWITCHED:
            answer = json.loads(frames[1].bytes)
            future = self._switched.get(answer.pop("ticket", None))
            if future is not None and not future.done():
                future.set_result(answer)
            return
        if kind != REPLIES:
            log.warning("engine %s sent a message of unknown kind %r", self.address, kind[:32])
            return
        for answer in wire.unpack_replies([f.buffer for f in frames[1:]]):
            job = self._jobs.pop(answer.id, None)
            if job is None or job.future.done():
                continue  # given up on
            job.enqueued, job.started, job.done = answer.enqueued, answer.started, answer.done
            if answer.error is not None:
                job.future.set_exception(answer.error)
            else:
                job.future.set_result(answer.rows)
