"""The verifier's FP8 tier (server/verify.py): batches whose GEMMs ran in FP8 are held to verify_tolerance_fp8, and
only sustained mismatches among them (FP8_MISMATCHES of the last FP8_WINDOW) move the model, once per streak; fp16
batches keep verify_tolerance and verify_action. The reference is a stand-in whose answer the test sets, so each
check's distance is known exactly."""

from __future__ import annotations

import numpy as np

from fusedserve.model.api import Description, Rows
from fusedserve.server.config import Settings
from fusedserve.server.metrics import Metrics
from fusedserve.server.verify import FP8_MISMATCHES, FP8_WINDOW, Verifier


class _Reference:
    """A model whose every answer is `rows` (set by the test): the verifier's reference copy."""

    def __init__(self) -> None:
        self.rows = np.array([[1.0, 0.0]], dtype=np.float32)

    def describe(self) -> Description:
        return Description(name="stand-in", kind="embedding", dim=2, max_length=8, device="cpu")

    def launch(self, rows: Rows):
        answer = self.rows

        class Done:
            def rows(self):
                return answer
        return Done()


def _served(distance: float) -> np.ndarray:
    # a unit vector at cosine distance `distance` from [1, 0]
    c = 1.0 - distance
    return np.array([[c, np.sqrt(1 - c * c)]], dtype=np.float32)


def _run(samples: list[tuple[float, str]], **settings) -> tuple[list[str], dict[str, float]]:
    """Each (distance, precision) checked in order on the verifier's thread; the reasons it raised, and its counts."""
    moved: list[str] = []
    metrics = Metrics().for_model("m")
    verifier = Verifier(_Reference(), Settings(verify_sample_rate=1, verify_queue=len(samples) + 1, **settings),
                        metrics, moved.append)
    rows = Rows.of([[1, 2, 3]])
    for distance, precision in samples:
        verifier.submit(rows, _served(distance), precision)
    verifier.start()
    verifier.stop()
    registry = metrics.reference_checks
    counts = {r: registry.labels(r)._value.get() for r in ("match", "mismatch")}
    return moved, counts


def test_fp8_batches_are_held_to_their_own_tolerance():
    # 5e-3 misses the fp16 tolerance (1e-3) and meets the FP8 one (2e-2)
    moved, counts = _run([(5e-3, "fp8")] * 10)
    assert moved == [] and counts == {"match": 10, "mismatch": 0}
    moved, counts = _run([(5e-3, "native")], verify_action="fallback")
    assert moved == ["verify_mismatch"] and counts == {"match": 0, "mismatch": 1}


def test_only_sustained_fp8_mismatches_move_the_model_once_per_streak():
    bad, good = (5e-2, "fp8"), (1e-4, "fp8")
    # one short of the count within the window: counted, logged, nothing moves (verify_action=fallback or not)
    moved, counts = _run([bad, good] * (FP8_MISMATCHES - 1) + [good] * 5, verify_action="fallback")
    assert moved == [] and counts["mismatch"] == FP8_MISMATCHES - 1
    # the count reached: one move; the window starts again, so the next streak needs the full count again
    moved, _ = _run([bad] * FP8_MISMATCHES + [bad] * (FP8_MISMATCHES - 1))
    assert moved == ["fp8_mismatch"]
    # mismatches further apart than the window never add up
    spaced = ([bad] + [good] * (FP8_WINDOW - 1)) * FP8_MISMATCHES
    assert _run(spaced)[0] == []
    # fp16 mismatches do not count toward the FP8 tier, and without verify_action=fallback do not move anything
    assert _run([(5e-2, "native")] * FP8_MISMATCHES)[0] == []


def test_a_non_finite_fp8_answer_is_a_mismatch():
    moved, counts = _run([(float("nan"), "fp8")] * FP8_MISMATCHES)
    assert moved == ["fp8_mismatch"] and counts["mismatch"] == FP8_MISMATCHES
