"""FastAPI dependencies as Annotated aliases."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from fusedserve.server.service import Service


async def get_service(request: Request) -> Service:
    # async: FastAPI runs a plain-def dependency in its thread pool, a thread hop per request for an attribute read
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(get_service)]
