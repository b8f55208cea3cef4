"""The int8/uint8 calibration (server.calibration) as an engine hands it to its front-ends: the embeddings travel in
the description bit for bit, and a front-end that has them quantizes with them and runs no calibration forward; one
whose engine did not warm up runs the calibration texts through the engine once, as before."""

from __future__ import annotations

import asyncio
import json
import types

import numpy as np

from fusedserve.model.api import Rows
from fusedserve.server.calibration import Calibration, embeddings_from_json
from fusedserve.server.frontend import RemoteCalibration
from fusedserve.server.quantize import CALIBRATION_TEXTS, ranges_of, shape


def _embeddings(width: int = 24) -> np.ndarray:
    rng = np.random.default_rng(7)
    # values no decimal text would carry exactly: the float32 bits must come back unchanged
    return (rng.standard_normal((len(CALIBRATION_TEXTS), width)) * np.float32(1 / 3)).astype(np.float32)


def _shipped(embeddings: np.ndarray | None) -> dict | None:
    """Calibration.to_json as the engine writes it, through the JSON text the description message carries."""
    calibration = Calibration(None, None, 64)
    calibration.embeddings = embeddings
    return json.loads(json.dumps(calibration.to_json()))


class _Engines:
    """A front-end's model as RemoteCalibration sees it: the text side and the engines' run, which counts forwards."""

    def __init__(self, width: int) -> None:
        self.width, self.forwards = width, 0
        self.model = types.SimpleNamespace(prepare=lambda texts, options: Rows.of([[1, 5 + i, 2] for i in
                                                                                    range(len(texts))]))
        self.settings = types.SimpleNamespace(max_batch_requests=64)

    async def run(self, rows: Rows, request):
        self.forwards += 1
        return types.SimpleNamespace(rows=np.full((len(rows), self.width), float(self.forwards), np.float32))


def test_the_embeddings_travel_bit_for_bit():
    embeddings = _embeddings()
    fields = _shipped(embeddings)
    back = embeddings_from_json(fields)
    assert back.dtype == np.float32 and back.shape == embeddings.shape
    assert back.tobytes() == embeddings.tobytes()
    assert _shipped(None) is None  # not computed (no warm-up): nothing to ship


def test_a_front_end_with_the_engines_embeddings_runs_no_calibration_forward():
    embeddings = _embeddings()
    engines = _Engines(embeddings.shape[1])
    calibration = RemoteCalibration(engines)
    calibration.adopt(_shipped(embeddings))

    async def ranges():
        return [await calibration.ranges(normalize, dimensions) for normalize in (True, False) for dimensions in
                (None, 8)]

    got = asyncio.run(ranges())
    assert engines.forwards == 0
    want = [ranges_of(shape(embeddings, normalize=n, dimensions=d)) for n in (True, False) for d in (None, 8)]
    for g, w in zip(got, want):
        assert g.tobytes() == w.tobytes()  # the engine's own ranges, as one process computes them
    assert calibration.info()["ranges"] == ranges_of(shape(embeddings, normalize=True, dimensions=None)).tolist()


def test_without_the_engines_embeddings_the_front_end_runs_them_once_and_keeps_them():
    engines = _Engines(16)
    calibration = RemoteCalibration(engines)
    calibration.adopt(None)  # an engine that did not warm up
    assert calibration.info() is None

    async def twice():
        return await calibration.ranges(True, None), await calibration.ranges(False, None)

    asyncio.run(twice())
    step = min(engines.settings.max_batch_requests, 32)
    assert engines.forwards == -(-len(CALIBRATION_TEXTS) // step)  # once, in batches of the calibration's step
    computed = calibration.embeddings
    calibration.adopt(_shipped(_embeddings(16)))  # a later description (another engine) changes nothing
    assert calibration.embeddings is computed
