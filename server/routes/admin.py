"""Admin routes: only with `Authorization: Bearer <FUSEDSERVE_ADMIN_TOKEN>`, and absent (404) when no
token is configured. POST /admin/fused switches one model's kernel path (`model`) or every model's."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import APIRouter, Depends, Header
from pydantic import BaseModel, Field, StrictBool

from fusedserve.server.deps import ServiceDep
from fusedserve.server.errors import Conflict, NotFound, Unauthorized

router = APIRouter(prefix="/admin", tags=["admin"])


def require_admin(service: ServiceDep, authorization: Annotated[str | None, Header()] = None) -> None:
    token = service.settings.admin_token
    if not token:
        raise NotFound("admin routes are disabled (no admin token configured)")
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), token.encode()):
        raise Unauthorized("missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})


Admin = Depends(require_admin)


class FusedSwitch(BaseModel):
    enabled: StrictBool
    model: str | None = Field(None, description="the model to switch; absent: every model")


@router.post("/fused", dependencies=[Admin])
async def set_fused(body: FusedSwitch, service: ServiceDep) -> dict:
    """Each model switched reports its path; the top level repeats the first one's (a one-model server's answer).
    With WORKERS > 1 a 409: the request would reach one worker of several, leaving the others on their path."""
    if service.settings.workers > 1:
        raise Conflict(f"the fused switch acts on one process and this server runs {service.settings.workers} "
                       "workers: set FUSEDSERVE_FUSED=false (or WORKERS=1) and restart")
    switched = await service.set_fused(body.enabled, body.model)
    # auto attention follows the switch (the few-token layer only while its ops are fused)
    states = {m.name: {"fused": state["fused"], "attention": state["attention"],
                       "attention_reason": state["attention_reason"], "kernels": state["kernels"]}
              for m, state in switched}
    first = next(iter(states))
    return {"model": first, **states[first], "models": states}
