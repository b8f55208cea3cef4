"""A model's runtime switches: the admin's fused switch and the verifier's fallbacks (every op to the reference, or
the FP8 GEMMs back to the model's dtype). Each runs on the model's batcher thread between two batches, never beside a
forward, and publishes what it changed: the model's description (what /info, the routes and the verifier's feed
read) and its kernel backends in the metrics."""

from __future__ import annotations

import concurrent.futures
import gc
import logging
from typing import TYPE_CHECKING

import numpy as np

from fusedserve.model.api import Description, Rows
from fusedserve.server.errors import ServiceError, Timeout, Unavailable

if TYPE_CHECKING:
    from fusedserve.server.model_service import ModelService

log = logging.getLogger("fusedserve")

# the admin switch's answer waits this long for the worker to apply it
SWITCH_TIMEOUT_S = 120


def refreeze() -> None:
    """One full collection, then every surviving object frozen out of the collector's sight: before ready (the
    start's objects), and after a switch dropped the start's selection and graphs, so cycles among the dropped objects
    (graphs holding device memory) are freed. After a switch it runs on the worker thread, between batches: the pause
    delays the next batch once per switch."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def state(description: Description) -> dict:
    """What /info and the fused switch's answer say of a model: kind, dim, its outputs (model.api.Output: "colbert"
    and "sparse" beside "pooled" and "tokens" for BGE-M3), head, labels or prompts, fused, fallback, kernels,
    attention, CUDA graphs."""
    return {"kind": description.kind, "dim": description.dim, "outputs": list(description.outputs),
            **description.info}


class Switches:
    """The switches of one loaded model (its ModelService: the model, its batcher, verifier and metrics)."""

    def __init__(self, served: ModelService) -> None:
        self.served = served

    def publish(self, description: Description) -> None:
        """The model as it runs now: its description, and its backends in the metrics. Ops the model does not call
        are left out: a dashboard row saying "torch" for them would read as a fallback."""
        m = self.served
        m.description = description
        m.metrics.set_backends(dict(description.kernels), description.fused)
        m.metrics.fp8_enabled.set(1 if description.precision == "fp8" else 0)

    def verify(self, rows: Rows, block: np.ndarray) -> None:
        """The batcher's thread, after a sampled batch: to the verifier, with the precision it ran at (the one
        published: switches run between batches on that thread)."""
        self.served.verifier.submit(rows, block, self.served.description.precision)

    def on_mismatch(self, reason: str) -> None:
        """The verifier saw fused outputs differ from the reference. "fp8_mismatch" (sustained, on FP8 batches): the
        GEMMs go back to the model's dtype, on its fused path. "verify_mismatch" (verify_action=fallback): every op
        the model calls falls back to the reference, as the fused switch would."""
        m = self.served
        if reason == "fp8_mismatch":
            m.batcher.between_batches(lambda: self._leave_fp8(reason))
            return

        def apply() -> None:
            ops = m.model.fall_back(reason)
            if not ops:
                return
            refreeze()
            for op in ops:
                m.metrics.fallbacks.labels(op, reason).inc()
            self.publish(m.model.describe())
            log.error("fallback: every op of %s now runs on the reference path (%s)", m.name, reason)

        m.batcher.between_batches(apply)

    def _leave_fp8(self, reason: str) -> None:
        m = self.served
        if not m.model.fall_back_precision(reason):
            return
        # counted at once: /info reports the move from here on, and a scrape that sees it there sees the count
        m.metrics.precision_fallbacks.labels(reason).inc()
        self.publish(m.model.describe())
        refreeze()
        log.error("precision fallback: the GEMMs of %s run in %s again, on its fused path (%s: FP8 outputs kept "
                  "missing the reference beyond verify_tolerance_fp8)", m.name, m.description.info.get("dtype"),
                  reason)

    def set_fused(self, enabled: bool) -> dict:
        """The admin switch: select again with the fused path on or off (clears a fallback). A selection that cannot
        be made (a forced backend failing its self-test) leaves the path as it was and answers 503 saying why."""
        m = self.served

        def apply() -> dict:
            description = m.model.set_fused(enabled)
            refreeze()
            self.publish(description)
            return state(description)

        future = m.batcher.between_batches(apply)
        try:
            return future.result(timeout=SWITCH_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise Timeout(f"the switch did not finish within {SWITCH_TIMEOUT_S} s; it still applies between "
                          "batches") from None
        except ServiceError:
            raise
        except Exception as exc:  # the model kept its previous selection
            raise Unavailable(f"the kernel path of {m.name} was not changed: {type(exc).__name__}: {exc}") from exc
