"""A request's deadline: request_timeout_s from its arrival (the first byte the app or the gRPC server saw of it: the
body's read, tokenizing and waiting for the batcher all count). Computed once from the request's record and carried
through its preparing, its queue and its forward; what is left of it bounds each wait, and an expired one is the
same 504 wherever it is noticed. A request whose inputs are in a running batch at its deadline is answered 504 only
request_grace_s after it (a forward cannot be stopped once it runs; its inputs not yet started are dropped at the
deadline itself, server.batcher)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from fusedserve.server.errors import Timeout
from fusedserve.server.observability import CURRENT


@dataclass(slots=True)  # not frozen: made once per request, where a frozen dataclass's init costs several times more
class Deadline:
    at: float  # time.monotonic()
    timeout_s: float  # request_timeout_s, named in the 504

    @classmethod
    def of_request(cls, timeout_s: float) -> Deadline:
        """The current request's (observability.CURRENT), from its arrival; outside a request (warm-up, tests),
        timeout_s from now."""
        record = CURRENT.get()
        return cls((record.started if record is not None else time.monotonic()) + timeout_s, timeout_s)

    def left(self) -> float:
        """Seconds left; the 504 once none is."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise self.expired()
        return left

    def expired(self) -> Timeout:
        """The 504 of a request not served by its deadline."""
        return not_served(self.timeout_s)


def not_served(timeout_s: float) -> Timeout:
    """The 504 of a request not served within timeout_s (request_timeout_s), wherever it is noticed: the request path,
    or the batcher dropping its inputs not yet run."""
    return Timeout(f"not served within {timeout_s:g}s")
