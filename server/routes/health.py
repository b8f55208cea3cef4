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


@router.get("/readyz", responses={503: {"description": "loading (with the phase and its progress), failed, or "
                                              "draining"}})
async def readyz(service: ServiceDep):
    """200 once the model is loaded and warmed up. Until then 503 with what is happening:
    `{"status": "loading", "phase": "loading" | "warmup" | "cuda_graphs" | "calibration", "progress": 0..1 | null,
    "elapsed_s"}`; `{"status": "failed", ...}` if the start failed; `{"status": "draining"}` after SIGTERM."""
    state = service.readiness()
    if state["status"] == "ready":
        return state
    message = state["status"] if state["status"] != "loading" else f"loading: {state['phase']}"
    return JSONResponse({**state, **error_body("unavailable", message)}, status_code=503)


@router.get("/info")
async def info(service: ServiceDep) -> dict:
    return service.info()


@router.get("/metrics")
async def metrics(service: ServiceDep) -> Response:
    return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)
