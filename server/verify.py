"""Sampled shadow checks: a copy of a sampled batch's token ids and served (fused) embeddings goes to a
background thread that recomputes them with its own fp32 reference copy of the model (Embedder.reference_copy:
torch ops, no state shared with the serving worker) and compares. Responses are never delayed: the queue is bounded
and a full queue drops the sample (counted). With verify_action=fallback a mismatch switches every op to the
reference (per-op attribution is not possible from pooled outputs)."""

from __future__ import annotations

import copy
import logging
import queue
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fusedserve.model.runner import Embedder
from fusedserve.server.config import Settings
from fusedserve.server.metrics import ModelMetrics

log = logging.getLogger("fusedserve.verify")


class Verifier:
    def __init__(self, reference: Embedder, settings: Settings, metrics: ModelMetrics,
                 on_mismatch: Callable[[str], None]) -> None:
        """reference: this thread's own model on the reference path (Embedder.reference_copy()); metrics: the
        model's own series. One verifier per model."""
        self.settings, self.metrics, self.on_mismatch = settings, metrics, on_mismatch
        self.reference = reference
        self._queue: queue.Queue = queue.Queue(maxsize=settings.verify_queue)
        self._thread = threading.Thread(target=self._run, name=f"fusedserve-verify[{metrics.model}]",
                                        daemon=True)
        self.checked = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def submit(self, ids: list[list[int]], served: torch.Tensor) -> None:
        try:
            # shallow copies keep what a row carries beside its ids (a text pair's second-text start)
            self._queue.put_nowait(([copy.copy(r) for r in ids], served.detach().clone()))
        except queue.Full:
            self.metrics.reference_checks.labels("dropped").inc()

    def _run(self) -> None:
        while (sample := self._queue.get()) is not None:
            ids, served = sample
            try:
                expected = self.reference.embed_ids(ids, normalize=False)
                if self.reference.kind == "classifier":
                    # logits: their size is the answer (a cosine of one-label logits is 0 or 2), so the error
                    # relative to the logits' scale stands in for the cosine distance
                    max_abs = float((served.float() - expected.float()).abs().max())
                    distance = max_abs / max(1.0, float(expected.abs().max()))
                else:
                    a, b = F.normalize(served.float(), dim=1), F.normalize(expected.float(), dim=1)
                    max_abs = float((a - b).abs().max())
                    distance = float((1 - (a * b).sum(dim=1)).max())
            except Exception:
                log.exception("reference check failed")
                self.metrics.reference_checks.labels("error").inc()
                continue
            finally:
                self.checked += 1
            self.metrics.reference_max_abs_error.set(max_abs)
            self.metrics.reference_cosine_distance.set(distance)
            ok = torch.isfinite(served).all() and distance <= self.settings.verify_tolerance
            self.metrics.reference_checks.labels("match" if ok else "mismatch").inc()
            if not ok:
                log.error("fused output differs from the reference: cosine distance %.3g, max abs %.3g (tolerance %g)",
                          distance, max_abs, self.settings.verify_tolerance)
                if self.settings.verify_action == "fallback":
                    self.on_mismatch("verify_mismatch")
