"""The start's objects are frozen out of the garbage collector before ready, so a full collection during serving
walks only what requests leave behind (not the hundreds of thousands of objects torch, the model and the compiled
kernels hold)."""

from __future__ import annotations

import gc

from server.config import Settings
from server.service import Service


def test_the_start_is_frozen_before_ready():
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    service = Service(Settings(model="tiny", device="cpu", warmup=False))
    try:
        thread = service.start()
        thread.join(timeout=120)
        assert service.phase == "ready", service.load_error
        frozen = gc.get_freeze_count()
        assert frozen > 10_000, frozen  # torch's modules and the model at least
        gc.collect()
        # a full collection now skips them: far fewer objects are tracked than were frozen
        assert len(gc.get_objects()) < frozen, (len(gc.get_objects()), frozen)
    finally:
        service.shutdown()
        gc.unfreeze()
