"""`python -m tests.support.server`: the real server with test-only hooks mounted. The product has no fault
injection; these routes wrap one op of the running model's selection (KernelPath.use with Selection.with_impl), on
the batcher's thread between batches, exactly as the product changes its path.

POST /admin/faults {"op", "mode", "factor", "model"}: make the op of the model (absent: the first) raise, scale its
output by `factor`, emit NaN, stall `factor` seconds per call, or run out of memory on inputs of more than `factor`
rows. DELETE /admin/faults: every model back to its selection from before its first fault.

Fake GPUs on a machine without one, for the workers' placement: TEST_FAKE_GPUS="cuda:0,cuda:1" makes those the
visible GPUs; each runs its workers (or the one process a single placement makes) on the CPU under its own name,
except those in TEST_BROKEN_GPUS, whose workers ask torch for that CUDA device and fail their start as a broken GPU
would."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from functools import partial
from typing import Literal

import torch
from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from fusedserve.server import devices
from fusedserve.server.__main__ import main
from fusedserve.server.app import create_app
from fusedserve.server.deps import ServiceDep
from fusedserve.server.errors import Unprocessable
from fusedserve.server.routes.admin import require_admin

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])


class Fault(BaseModel):
    op: str
    mode: Literal["scale", "raise", "nan", "delay", "oom"] = "scale"
    factor: float = Field(1.05, description="scale: output multiplier; delay: seconds per call; oom: max rows")
    model: str | None = None


def faulty(op: str, mode: str, factor: float, original):
    def call(*args, **kwargs):
        if mode == "raise":
            raise RuntimeError(f"injected fault in {op}")
        if mode == "delay":
            time.sleep(factor)
            return original(*args, **kwargs)
        if mode == "oom" and args[0].shape[0] > factor:
            raise torch.cuda.OutOfMemoryError(f"injected out-of-memory in {op} ({args[0].shape[0]} rows)")
        out = original(*args, **kwargs)
        if mode == "oom":
            return out
        first = out[0] if isinstance(out, tuple) else out
        if mode == "nan":
            first.fill_(float("nan"))
        else:
            first.mul_(factor)
        return out

    return call


@router.post("/faults")
async def add_fault(body: Fault, service: ServiceDep) -> dict:
    model = service.model(body.model)
    embedder = model.model.embedder  # the test hook reaches past the seam: the product never does
    if body.op not in embedder.kernel_path.selection.impls:
        raise Unprocessable(f"unknown op {body.op!r}")
    faults = model.test_faults = getattr(model, "test_faults", {"before": None, "ops": {}})

    def apply() -> None:
        selection = embedder.kernel_path.selection
        faults["before"] = faults["before"] or selection
        wrapped = faulty(body.op, body.mode, body.factor, selection.impls[body.op])
        embedder.kernel_path.use(selection.with_impl(body.op, wrapped, f"test fault: {body.mode} x{body.factor:g}"))
        faults["ops"][body.op] = {"mode": body.mode, "factor": body.factor}

    await asyncio.to_thread(lambda: model.batcher.between_batches(apply).result(timeout=10))
    return {"faults": faults["ops"]}


@router.delete("/faults")
async def clear_faults(service: ServiceDep) -> dict:
    for model in service.serving:
        faults = getattr(model, "test_faults", None)
        if faults and faults["before"] is not None:
            restore = partial(model.model.embedder.kernel_path.use, faults["before"])
            await asyncio.to_thread(model.batcher.between_batches(restore).result, 10)
            faults["before"], faults["ops"] = None, {}
    return {"faults": {}}


def create_test_app(settings):
    fake = [g for g in os.environ.get("TEST_FAKE_GPUS", "").split(",") if g]
    broken = set(os.environ.get("TEST_BROKEN_GPUS", "").split(","))
    if settings.device in fake and settings.device not in broken:
        # a server of one process on one fake GPU (DEVICE=cuda:0 coming to one worker) loads its models through its
        # setting, not a placement: the fake name resolves to the CPU here (in the serving process only: the
        # parent of workers must not import the model package before it starts them)
        from fusedserve.model import loading

        resolve = loading.resolve_device
        loading.resolve_device = lambda device: resolve("cpu" if device == settings.device else device)
    app = create_app(settings)
    app.include_router(router)
    return app


def _fake_gpus() -> None:
    fake = [g for g in os.environ.get("TEST_FAKE_GPUS", "").split(",") if g]
    if not fake:
        return
    broken = set(os.environ.get("TEST_BROKEN_GPUS", "").split(","))
    devices.visible_gpus = lambda: list(fake)
    devices.runs_on = lambda name: name if name in broken else "cpu"


if __name__ == "__main__":
    _fake_gpus()
    sys.exit(main(app_factory=create_test_app))
