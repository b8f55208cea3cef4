"""The int8/uint8 output types' ranges of one model (server.quantize): the embeddings of CALIBRATION_TEXTS, computed
once on the model's batcher thread (at warm-up, or at the first request that asks for a quantized output), and their
per-dimension min and max shaped as each request shapes its own (normalized or not, the first `dimensions`).
An engine's description carries the embeddings of its warm-up to its front-ends (to_json, embeddings_from_json): a
front-end quantizes with the engine's own, to the bit, and runs no calibration forward of its own."""

from __future__ import annotations

import asyncio
import base64

import numpy as np

from fusedserve.model.api import ServedModel, TextOptions
from fusedserve.server.batcher import Batcher
from fusedserve.server.quantize import CALIBRATION_TEXTS, ranges_of, shape

# calibration inputs per forward (fewer where max_batch_requests is lower)
CALIBRATION_BATCH = 32


class Calibration:
    def __init__(self, model: ServedModel, batcher: Batcher, max_batch_requests: int) -> None:
        self.model, self.batcher = model, batcher
        self.step = min(max_batch_requests, CALIBRATION_BATCH)
        self.embeddings: np.ndarray | None = None  # raw, [len(CALIBRATION_TEXTS), width] float32
        self._ranges: dict[tuple[bool, int | None], np.ndarray] = {}
        self._computing: asyncio.Lock | None = None  # made on the event loop, at the first request that waits

    def embed(self) -> np.ndarray:
        """Raw embeddings of CALIBRATION_TEXTS, on the worker thread (in batches the limits allow)."""
        rows = self.model.prepare(list(CALIBRATION_TEXTS), TextOptions())
        return np.concatenate([self.model.launch(rows.slice(i, min(i + self.step, len(rows)))).rows()
                               for i in range(0, len(rows), self.step)]).astype(np.float32)

    def compute(self) -> None:
        """The embeddings, now (warm-up, on the loading thread): between two batches of the worker."""
        self.embeddings = self.batcher.between_batches(self.embed).result()

    async def ranges(self, normalize: bool, dimensions: int | None) -> np.ndarray:
        """[2, width] per-dimension min and max of the calibration embeddings, shaped as the request's own are;
        the embeddings are computed here when warm-up did not."""
        if self.embeddings is None:
            self._computing = self._computing or asyncio.Lock()
            async with self._computing:
                if self.embeddings is None:
                    self.embeddings = await self._computed()
        key = (normalize, dimensions)
        if key not in self._ranges:
            self._ranges[key] = ranges_of(shape(self.embeddings, normalize=normalize, dimensions=dimensions))
        return self._ranges[key]

    async def _computed(self) -> np.ndarray:
        """The embeddings, computed for a request that waits (on the worker thread, between two batches)."""
        return await asyncio.wrap_future(self.batcher.between_batches(self.embed))

    def to_json(self) -> dict | None:
        """The embeddings as an engine's description carries them (None until computed): their float32 bytes,
        little-endian, in base64, so the front-end's copy is the engine's to the bit."""
        if self.embeddings is None:
            return None
        data = np.ascontiguousarray(self.embeddings, dtype="<f4").tobytes()
        return {"shape": list(self.embeddings.shape), "float32": base64.b64encode(data).decode("ascii")}

    def info(self) -> dict | None:
        """/info's `quantization`: the per-dimension [min, max] of normalized full-width embeddings (None until
        computed)."""
        if self.embeddings is None:
            return None
        return {"calibration_texts": len(CALIBRATION_TEXTS),
                "ranges": ranges_of(shape(self.embeddings, normalize=True, dimensions=None)).tolist()}


def embeddings_from_json(fields: dict) -> np.ndarray:
    """The embeddings Calibration.to_json wrote."""
    data = np.frombuffer(base64.b64decode(fields["float32"]), dtype="<f4")
    return data.reshape(fields["shape"]).astype(np.float32)
