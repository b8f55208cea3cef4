"""An input's embedding must not depend on what else is in its batch."""

from __future__ import annotations

from model.runner import Embedder
from tests.model.sentences import SENTENCES


def test_single_equals_in_batch_of_32():
    embedder = Embedder.load("default", device="cpu", dtype="float32", backend="torch")[0]
    batch = SENTENCES[:28] + SENTENCES[-4:]  # varied lengths, long ones included
    assert len(batch) == 32
    together = embedder.embed(batch)
    for i in (0, 9, 27, 28, 31):
        alone = embedder.embed([batch[i]])[0]
        diff = float((together[i] - alone).abs().max())
        assert diff <= 1e-5, f"sentence {i}: batch vs alone differ by {diff}"
    # and order within the batch does not matter
    reversed_ = embedder.embed(batch[::-1]).flip(0)
    assert float((together - reversed_).abs().max()) <= 1e-5
