"""Admin routes: only with `Authorization: Bearer <FUSEDSERVE_ADMIN_TOKEN>`, and absent (404) when no
token is configured. Fault injection exists only with FUSEDSERVE_FAULT_INJECTION=true (tests)."""

from __future__ import annotations

import asyncio
import secrets
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Header
from pydantic import BaseModel, Field

from kernels.registry import OPS
from server.deps import ServiceDep
from server.errors import NotFound, Unauthorized, Unprocessable

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
    enabled: bool


@router.post("/fused", dependencies=[Admin])
async def set_fused(body: FusedSwitch, service: ServiceDep) -> dict:
    kernels = await asyncio.to_thread(service.set_fused, body.enabled)
    embedder = service.embedder  # auto attention follows the switch (the few-token layer only while it is fused)
    return {"fused": body.enabled, "attention": embedder.attention, "attention_reason": embedder.attention_reason,
            "kernels": kernels["ops"]}


class Fault(BaseModel):
    op: str
    mode: Literal["scale", "raise", "nan", "delay", "oom"] = "scale"
    factor: float = Field(1.05, description="scale: output multiplier; delay: seconds per call; oom: max rows")


@router.post("/faults", dependencies=[Admin])
async def add_fault(body: Fault, service: ServiceDep) -> dict:
    if not service.settings.fault_injection:
        raise NotFound("fault injection is disabled")
    if body.op not in OPS:
        raise Unprocessable(f"unknown op {body.op!r}")
    await asyncio.to_thread(service.set_fault, body.op, body.mode, body.factor)
    return {"faults": service.info()["faults"]}


@router.delete("/faults", dependencies=[Admin])
async def clear_faults(service: ServiceDep) -> dict:
    if not service.settings.fault_injection:
        raise NotFound("fault injection is disabled")
    await asyncio.to_thread(service.clear_faults)
    return {"faults": {}}
