"""ColBERT models on the GPU in float16 and bfloat16: query and document vectors of every golden variant (BERT and
ModernBERT bodies, expansion tokens attended or not) against PyLate's float32 outputs (tests/model/golden/pylate.json,
which tests/model/test_colbert.py holds the CPU path to), within the embedding table; MaxSim scores within the
scores table."""

from __future__ import annotations

import numpy as np
import pytest

from fusedserve.model import load
from fusedserve.model.api import LoadOptions, TextOptions, multi_vector_counts
from tests.model import checkpoints
from tests.model.test_colbert import GOLDEN, ROLES, VARIANTS
from tests.tolerances import assert_embeddings_close, assert_scores_close

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_colbert_vectors_on_the_gpu(tmp_path, variant, dtype):
    golden = GOLDEN["variants"][variant]
    model = load(str(checkpoints.colbert(tmp_path / variant, **golden["builder"])), LoadOptions(device="cuda",
                                                                                              dtype=dtype))
    try:
        encoded = {}
        for key, role in ROLES.items():
            rows = model.prepare(GOLDEN[key], TextOptions(prompt_name=role))
            block = model.launch(rows, output="colbert").rows()
            encoded[key] = np.split(block, np.cumsum(multi_vector_counts(model.describe(), rows))[:-1])
            for text, mine, theirs in zip(GOLDEN[key], encoded[key], golden[key]):
                assert len(mine) == len(theirs["vectors"]), (variant, role, text)
                assert_embeddings_close(mine, theirs["vectors"], dtype=dtype, what=f"{variant} {role} {text!r}")
        scores = [[float((q @ d.T).max(axis=1).sum()) for d in encoded["documents"]] for q in encoded["queries"]]
        assert_scores_close(scores, golden["scores_unpadded"], dtype, logits=True, what=f"{variant} MaxSim")
    finally:
        model.stop()
