"""An input's embedding must not depend on what else is in its batch."""

from __future__ import annotations

from fusedserve.model.runner import Embedder
from tests.model.sentences import SENTENCES
from tests.tolerances import assert_embeddings_close


def test_single_equals_in_batch_of_32():
    embedder = Embedder.load("default", device="cpu", dtype="float32", backend="torch")[0]
    batch = SENTENCES[:28] + SENTENCES[-4:]  # varied lengths, long ones included
    assert len(batch) == 32
    together = embedder.embed(batch)
    for i in (0, 9, 27, 28, 31):
        assert_embeddings_close(together[i], embedder.embed([batch[i]])[0], what=f"sentence {i} in a batch vs alone")
    # and order within the batch does not matter
    assert_embeddings_close(together, embedder.embed(batch[::-1]).flip(0), what="batch vs the batch reversed")
