"""POST /infer: the service's own embedding route."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from fusedserve.model.api import TextOptions
from fusedserve.server.deps import ServiceDep
from fusedserve.server.responses import EmbeddingResponse, LeanRoute

router = APIRouter(tags=["inference"], route_class=LeanRoute)

Encoding = Literal["float", "base64", "int8", "uint8", "binary", "ubinary"]
MODEL_HELP = "which of the server's models (GET /v1/models); absent: the first embedding model"
ENCODING_HELP = ("output type: `float`; `base64` (each row's float32 bytes, little-endian); `int8` / `uint8` "
                 "(per-dimension calibrated ranges); `binary` / `ubinary` (sign bits packed 8 to a byte, as int8 / "
                 "uint8); sentence-transformers' quantize_embeddings semantics")

MultiVectorEncoding = Literal["float", "base64", "base64_float16"]  # quantize.MULTI_VECTOR_ENCODINGS
MULTI_VECTOR_HELP = ("per-token output type: `float` (nested lists); `base64` / `base64_float16`: per input "
                     "`{shape: [tokens, dim], dtype, data}`, data the little-endian row-major float32 / float16 bytes "
                     "in base64 (44% / 22% of float JSON's size; a body over max_response_bytes is a 413)")


class EncodedVectors(BaseModel):
    shape: list[int]
    dtype: Literal["float32", "float16"]
    data: str


class StrictRequest(BaseModel):
    """A request body whose unknown fields are a 422 naming them (a typo such as `normalise` must not pass as a
    default), as OpenAI's API refuses an unrecognized argument: /infer's and the OpenAI routes' requests. The TEI and
    KServe routes accept and ignore unknown fields, as those servers do (docs/architecture.md)."""

    model_config = ConfigDict(extra="forbid")


class InferRequest(StrictRequest):
    inputs: str | list[str] = Field(..., description="one text or a list of texts")
    normalize: StrictBool = Field(True, description="L2-normalize each embedding")
    truncate: StrictBool = Field(True, description="cut inputs at max_seq_length tokens; false makes an over-long "
                                 "input a 413")
    encoding_format: Encoding = Field("float", description=ENCODING_HELP)
    prompt_name: str | None = Field(None, description="one of the model's prompts (sentence-transformers' prompts), "
                                    "put before each input; absent: the model's default prompt, if it has one")
    model: str | None = Field(None, description=MODEL_HELP)


class Usage(BaseModel):
    tokens: int


class InferResponse(BaseModel):
    embeddings: list[list[float]] | list[list[int]] | list[str]
    model: str
    dim: int
    usage: Usage


@router.post("/infer", response_model=InferResponse)
async def infer(body: InferRequest, service: ServiceDep, request: Request) -> EmbeddingResponse:
    model = service.model(body.model, "embedding")
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    result = await model.embed(texts, TextOptions(truncate=body.truncate, prompt_name=body.prompt_name), request,
                               normalize=body.normalize)
    embeddings = await model.output(result.rows, body.encoding_format, normalize=body.normalize)
    return EmbeddingResponse({"embeddings": embeddings, "model": model.name,
                              "dim": model.dim, "usage": {"tokens": result.tokens}})
