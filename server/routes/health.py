"""Liveness, readiness, /info and /metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from fusedserve.server.deps import ServiceDep
from fusedserve.server.errors import error_body

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "loading (with the phase and its progress), failed, or "
                                              "draining"}})
async def readyz(service: ServiceDep):
    """200 once every model is loaded and warmed up (`"failed": {model: reason}` lists those skipped with
    model_load_failure=skip). Until then 503 with what is happening: `{"status": "loading", "model", "phase":
    "loading" | "warmup" | "cuda_graphs" | "calibration" | "loaded", "progress": 0..1 | null, "elapsed_s"}` (the model
    loading now); `{"status": "failed", ...}` if the start failed; `{"status": "draining"}` after SIGTERM."""
    state = service.readiness()
    if state["status"] == "ready":
        return state
    message = state["status"] if state["status"] != "loading" else \
        f"loading: {state['phase']}" + (f" ({state['model']})" if "model" in state else "")
    return JSONResponse({**state, **error_body("unavailable", message)}, status_code=503)


@router.get("/info")
async def info(service: ServiceDep) -> dict:
    """The server's state and limits, and per model (`models`; the first one's also at the top level): its kind, dim
    or labels, memory on the device, dtype, every op's backend and why, attention, CUDA graphs, calibration."""
    return service.info()


@router.get("/metrics")
async def metrics(service: ServiceDep) -> Response:
    body, media_type = service.metrics.exposition()
    return Response(body, media_type=media_type)
