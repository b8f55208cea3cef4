"""Admin routes: only with `Authorization: Bearer <FUSEDSERVE_ADMIN_TOKEN>`, and absent (404) when no
token is configured. POST /admin/fused switches one model's kernel path (`model`) or every model's, in every
worker."""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Annotated

from fastapi import APIRouter, Depends, Header
from pydantic import BaseModel, Field, StrictBool

from fusedserve.server.deps import ServiceDep
from fusedserve.server import workers
from fusedserve.server.errors import NotFound, Unauthorized, Unavailable

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
    With WORKERS > 1 every worker switches (`workers`: how many did, of how many), the answer coming once all have
    or after 30 s (then 503 saying how many had)."""
    if body.model:  # an unknown model: 404 before any worker moves
        service.model(body.model)
    service.check_ready()
    if service.follows_switch:
        switch = workers.publish_switch(body.enabled, body.model)
        switched = await service.shared_switch.apply(switch)
    else:
        switch, switched = None, await service.set_fused(body.enabled, body.model)
    # auto attention follows the switch (the few-token layer only while its ops are fused)
    states = {m.name: {"fused": state["fused"], "attention": state["attention"],
                       "attention_reason": state["attention_reason"], "kernels": state["kernels"]}
              for m, state in switched}
    first = next(iter(states))
    answer = {"model": first, **states[first], "models": states}
    if switch is not None:
        deadline = time.monotonic() + 30
        while (counts := workers.switched_workers(switch["generation"]))[0] < counts[1]:
            if time.monotonic() > deadline:
                raise Unavailable(f"the switch reached {counts[0]} of {counts[1]} workers within 30 s; the others "
                                  "apply it as they can")
            await asyncio.sleep(workers.SWITCH_POLL_S)
        answer["workers"] = {"switched": counts[0], "of": counts[1]}
    return answer
