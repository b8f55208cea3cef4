"""The embedding routes' JSON: orjson writes the [n, dim] float32 matrix straight from numpy.

Serializing embeddings through pydantic and the standard json module costs ~3 ms per 16 x 384 response on one
core (a Python float object and its repr per element) and runs on the event loop: under load that, not the model,
capped a GPU server at ~200 requests/s. orjson writes a float32 array in ~0.1 ms, each value as the shortest
decimal that reads back as the same float32 (the model's own precision). The routes keep their pydantic
response models for the OpenAPI schema; returning a Response skips FastAPI's re-validation of the output.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import JSONResponse


class EmbeddingResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
