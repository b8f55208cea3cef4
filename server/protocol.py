"""The HTTP/1.1 connection: uvicorn's httptools protocol with a deadline for each request's headers. uvicorn times
out a connection only while it is idle between two requests; one that connects and sends nothing, or half of its
headers, would be held for as long as the client liked, and enough of them take every file descriptor the process
has (docs/decisions/0028-a-deadline-for-request-headers.md). Each request's headers must be complete within
header_timeout_s of the connection opening or of the request's first byte, else the connection is closed (nginx's
client_header_timeout, hyper's header_read_timeout). The body has its own deadline (server.app.BodyLimit).

Past max_connections open connections, a request is marked in its scope (OVER_CAPACITY) and the app answers it 503
unless it is a probe (server.app.HeaderLimits): uvicorn's own limit_concurrency answers every request 503, the
Kubernetes probes included, which would restart a pod that is only busy. A connection opened past the cap gets
OVER_CAPACITY_HEADER_S for its headers, so idle or slow ones free their descriptors soon."""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


OVER_CAPACITY = "fusedserve.over_capacity"
OVER_CAPACITY_HEADER_S = 1.0


def guarded(timeout_s: float, max_connections: int) -> type[HttpToolsProtocol]:
    """The protocol class for uvicorn.Config(http=...), closing connections whose headers are late and marking the
    requests that arrive past max_connections open connections."""

    class HeaderDeadline(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None
        _timeout_s = timeout_s

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)  # adds this connection to the server's set
            if len(self.connections) > max_connections:
                self._timeout_s = min(timeout_s, OVER_CAPACITY_HEADER_S)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            if len(self.connections) > max_connections:
                self.scope[OVER_CAPACITY] = True  # type: ignore[literal-required]
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(self._timeout_s, self._late)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _late(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline
