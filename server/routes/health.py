"""Liveness, readiness, /info and /metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from server.deps import ServiceDep
from server.errors import error_body

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(service: ServiceDep):
    if service.draining:
        return JSONResponse(error_body("unavailable", "draining"), status_code=503)
    if not service.ready:
        return JSONResponse(error_body("unavailable", "loading"), status_code=503)
    return {"status": "ready"}


@router.get("/info")
async def info(service: ServiceDep) -> dict:
    return service.info()


@router.get("/metrics")
async def metrics(service: ServiceDep) -> Response:
    return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)
