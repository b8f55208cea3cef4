"""Sampled shadow checks: a copy of a sampled batch's token ids and served (fused) embeddings goes to a
background thread that recomputes them with its own fp32 reference copy of the model (ServedModel.reference_copy:
torch ops, no state shared with the serving worker) and compares. Responses are never delayed: the queue is bounded
and a full queue drops the sample (counted). With verify_action=fallback a mismatch switches every op to the
reference (per-op attribution is not possible from pooled outputs). Batches whose GEMMs ran in FP8 (precision=fp8)
are held to their own tolerance, and sustained mismatches there (FP8_MISMATCHES among the last FP8_WINDOW checks)
move the model's GEMMs back to its dtype, on the fused path, whatever verify_action says: one batch's FP8 rounding
can stray past the tolerance where a broken path strays on every batch."""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable

import numpy as np

from fusedserve.model.api import Rows, ServedModel, l2_normalize
from fusedserve.server.config import Settings
from fusedserve.server.metrics import ModelMetrics

log = logging.getLogger("fusedserve.verify")

FP8_WINDOW, FP8_MISMATCHES = 20, 3


class Verifier:
    def __init__(self, reference: ServedModel, settings: Settings, metrics: ModelMetrics,
                 on_mismatch: Callable[[str], None]) -> None:
        """reference: this thread's own model on the reference path (ServedModel.reference_copy()); metrics: the
        model's own series. One verifier per model."""
        self.settings, self.metrics, self.on_mismatch = settings, metrics, on_mismatch
        self.reference = reference
        description = reference.describe()
        self.kind, self.reference_bytes = description.kind, description.memory.get("parameters_bytes", 0)
        self._queue: queue.Queue = queue.Queue(maxsize=settings.verify_queue)
        self._thread = threading.Thread(target=self._run, name=f"fusedserve-verify[{metrics.model}]",
                                        daemon=True)
        self.checked = 0
        self._fp8_recent: deque[bool] = deque(maxlen=FP8_WINDOW)  # the last FP8 checks' outcomes (True: a match)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def submit(self, rows: Rows, served: np.ndarray, precision: str = "native") -> None:
        """A served batch: its rows (never written after they are prepared), a copy of its output block and the
        precision its GEMMs ran at."""
        try:
            self._queue.put_nowait((rows, served.copy(), precision))
        except queue.Full:
            self.metrics.reference_checks.labels("dropped").inc()

    def _run(self) -> None:
        while (sample := self._queue.get()) is not None:
            rows, served, precision = sample
            try:
                expected = self.reference.launch(rows).rows()
                if self.kind in ("classifier", "sparse"):
                    # logits: their size is the answer (a cosine of one-label logits is 0 or 2), so the error
                    # relative to the logits' scale stands in for the cosine distance; a sparse vector may be all
                    # zeros, which has no direction either
                    max_abs = float(np.abs(served - expected).max())
                    distance = max_abs / max(1.0, float(np.abs(expected).max()))
                else:
                    a, b = l2_normalize(served), l2_normalize(expected)
                    max_abs = float(np.abs(a - b).max())
                    distance = float((1 - (a * b).sum(axis=1)).max())
            except Exception:
                log.exception("reference check failed")
                self.metrics.reference_checks.labels("error").inc()
                continue
            finally:
                self.checked += 1
            self.metrics.reference_max_abs_error.set(max_abs)
            self.metrics.reference_cosine_distance.set(distance)
            fp8 = precision == "fp8"
            tolerance = self.settings.verify_tolerance_fp8 if fp8 else self.settings.verify_tolerance
            ok = bool(np.isfinite(served).all()) and distance <= tolerance
            self.metrics.reference_checks.labels("match" if ok else "mismatch").inc()
            if not ok:
                log.error("fused output%s differs from the reference: cosine distance %.3g, max abs %.3g (tolerance "
                          "%g)", " (FP8 GEMMs)" if fp8 else "", distance, max_abs, tolerance)
            if fp8:
                self._fp8_recent.append(ok)
                if self._fp8_recent.count(False) >= FP8_MISMATCHES:
                    self._fp8_recent.clear()
                    self.on_mismatch("fp8_mismatch")
            elif not ok and self.settings.verify_action == "fallback":
                self.on_mismatch("verify_mismatch")
