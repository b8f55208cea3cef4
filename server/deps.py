"""FastAPI dependencies as Annotated aliases, and the API-key check the HTTP middleware and the gRPC service share."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Request

from fusedserve.server.service import Service


async def get_service(request: Request) -> Service:
    # async: FastAPI runs a plain-def dependency in its thread pool, a thread hop per request for an attribute read
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(get_service)]


def key_matches(keys: list[bytes], given: bytes) -> bool:
    """`given` is one of `keys`, every key compared in constant time, so neither the timing nor the order says which
    one nearly matched (the HTTP middleware's check and the gRPC service's)."""
    matched = False
    for key in keys:
        matched |= secrets.compare_digest(given, key)
    return matched
