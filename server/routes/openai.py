"""OpenAI-compatible POST /v1/embeddings (float or base64 encoding, `dimensions`, token-id input)."""

from __future__ import annotations

import base64
from typing import Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from server.batcher import l2_normalize
from server.deps import ServiceDep
from server.errors import BadRequest, NotFound
from server.responses import EmbeddingResponse, LeanRoute

router = APIRouter(tags=["openai"], route_class=LeanRoute)


class EmbeddingsRequest(BaseModel):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, description="keep the first N dimensions (renormalized)")
    user: str | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingsUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingsUsage


@router.post("/v1/embeddings", response_model=EmbeddingsResponse)
async def embeddings(body: EmbeddingsRequest, service: ServiceDep, request: Request) -> EmbeddingResponse:
    service.check_ready()
    if body.model not in (None, "", service.model_name):
        raise NotFound(f"model {body.model!r} is not served here; this server serves {service.model_name!r}")
    if body.dimensions is not None and not 1 <= body.dimensions <= service.dim:
        raise BadRequest(f"dimensions must be between 1 and {service.dim}")
    data = body.input
    if isinstance(data, str):
        result = await service.embed_texts([data], normalize=True, truncate=True, request=request)
    elif data and all(isinstance(x, int) for x in data):
        result = await service.embed_ids(service.validate_ids([data], truncate=True), normalize=True, request=request)
    elif data and all(isinstance(x, list) for x in data):
        result = await service.embed_ids(service.validate_ids(data, truncate=True), normalize=True, request=request)
    else:
        result = await service.embed_texts(list(data), normalize=True, truncate=True, request=request)
    matrix = result.embeddings
    if body.dimensions is not None and body.dimensions < service.dim:
        matrix = l2_normalize(matrix[:, : body.dimensions])
    matrix = np.ascontiguousarray(matrix, dtype=np.float32)
    items = []
    for i, row in enumerate(matrix):
        value = base64.b64encode(row.tobytes()).decode() if body.encoding_format == "base64" else row
        items.append({"object": "embedding", "index": i, "embedding": value})
    return EmbeddingResponse({"object": "list", "data": items, "model": service.model_name,
                              "usage": {"prompt_tokens": result.tokens, "total_tokens": result.tokens}})
