"""POST /infer: the service's own embedding route."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from server.deps import ServiceDep
from server.responses import EmbeddingResponse, LeanRoute

router = APIRouter(tags=["inference"], route_class=LeanRoute)


class InferRequest(BaseModel):
    inputs: str | list[str] = Field(..., description="one text or a list of texts")
    normalize: bool = Field(True, description="L2-normalize each embedding")
    truncate: bool = Field(True, description="cut inputs at max_seq_length tokens; false makes an over-long input a 413")


class Usage(BaseModel):
    tokens: int


class InferResponse(BaseModel):
    embeddings: list[list[float]]
    model: str
    dim: int
    usage: Usage


@router.post("/infer", response_model=InferResponse)
async def infer(body: InferRequest, service: ServiceDep, request: Request) -> EmbeddingResponse:
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    result = await service.embed_texts(texts, normalize=body.normalize, truncate=body.truncate, request=request)
    return EmbeddingResponse({"embeddings": result.embeddings, "model": service.model_name,
                              "dim": service.dim, "usage": {"tokens": result.tokens}})
