"""The start's objects are frozen out of the garbage collector before ready, so a full collection during serving
walks only what requests leave behind (not the hundreds of thousands of objects torch, the model and the compiled
kernels hold)."""

from __future__ import annotations

import gc
import weakref

from fusedserve.server.config import Settings
from fusedserve.server.service import Service


def test_the_start_is_frozen_before_ready():
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    service = Service(Settings(model="tiny", device="cpu", warmup=False))
    at_ready = []
    mark_ready = service.mark_ready
    service.mark_ready = lambda: at_ready.append(gc.get_freeze_count()) or mark_ready()
    try:
        thread = service.start()
        thread.join(timeout=120)
        assert service.phase == "ready", service.load_error
        frozen = gc.get_freeze_count()
        assert at_ready and at_ready[0] > 10_000, at_ready  # before ready: torch's modules and the model at least
        gc.collect()
        # a full collection now skips them: far fewer objects are tracked than were frozen
        assert len(gc.get_objects()) < frozen, (len(gc.get_objects()), frozen)
    finally:
        service.shutdown()
        gc.unfreeze()



def test_a_switch_frees_what_the_start_froze():
    """The admin switch and the verifier's fallback drop the start's selection and graphs: refreeze lets one full
    collection free the dropped cycles, then freezes the survivors again."""
    from fusedserve.server.switches import refreeze

    class Cycle:
        pass

    gc.unfreeze()
    try:
        dropped = Cycle()
        dropped.me = dropped
        alive = weakref.ref(dropped)
        gc.collect()
        gc.freeze()
        del dropped  # a cycle the start made, dropped by a switch
        gc.collect()
        assert alive() is not None  # frozen: no collection frees it
        refreeze()
        assert alive() is None and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
