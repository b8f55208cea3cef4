"""BGE-M3 on the GPU in float16 and bfloat16: the three outputs of the served model (the fused path, the heads on the
device, kernels.m3_sparse on Triton) against the same directory's float32 CPU outputs, which tests/model/test_bge_m3.py
holds equal to FlagEmbedding's BGEM3FlagModel; dense and multi-vectors within the embedding table, the sparse
weights within the scores table with the same ids kept."""

from __future__ import annotations

import numpy as np
import pytest

from fusedserve.model import load
from fusedserve.model.api import LoadOptions, TextOptions
from tests.model import checkpoints
from tests.model.test_bge_m3 import TEXTS, vocabulary_rows
from tests.tolerances import assert_embeddings_close, assert_sparse_close

pytestmark = pytest.mark.gpu


def _outputs(path, device: str, dtype: str) -> tuple[dict[str, np.ndarray], dict]:
    model = load(str(path), LoadOptions(device=device, dtype=dtype))
    try:
        rows = model.prepare(TEXTS, TextOptions())
        got = {output: model.launch(rows, output=output).rows() for output in ("pooled", "colbert", "sparse")}
        got["sparse"] = vocabulary_rows(got["sparse"], rows, model.embedder.config.vocab_size)
        return got, dict(model.describe().kernels)
    finally:
        model.stop()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_three_outputs_on_the_gpu(tmp_path, dtype):
    path = checkpoints.bge_m3(tmp_path / "bge-m3")
    want, _ = _outputs(path, "cpu", "float32")
    got, kernels = _outputs(path, "cuda", dtype)
    assert kernels.get("m3_sparse") == "triton", kernels
    def unit(x):  # launch gives the raw CLS rows; the server normalizes them
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    assert_embeddings_close(unit(got["pooled"]), unit(want["pooled"]), dtype=dtype, what="dense")
    assert_embeddings_close(got["colbert"], want["colbert"], dtype=dtype, what="colbert vectors")
    assert (got["sparse"] > 0).sum() > 0
    assert_sparse_close(got["sparse"], want["sparse"], dtype=dtype, what="sparse weights")
