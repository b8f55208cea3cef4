"""OpenAI-compatible embeddings and models: POST /v1/embeddings (texts or token ids; `encoding_format` float, base64 or
a quantized type, or `sparse` for a SPLADE model, whose vectors come as TEI's /embed_sparse gives them; `dimensions`; `truncate` as on /infer; `model` picks one of the server's models), GET /v1/models
(every model that loaded) and GET /v1/models/{model_id}. Errors on /v1/* come in OpenAI's shape (server.errors); an unknown
model is a 404 with code model_not_found, as OpenAI answers it."""

from __future__ import annotations

import asyncio
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, StrictBool, StrictInt

from fusedserve.model.api import TextOptions
from fusedserve.server.deadline import Deadline
from fusedserve.server.deps import ServiceDep
from fusedserve.server.errors import Unprocessable
from fusedserve.server.quantize import MULTI_VECTOR_ENCODINGS, encode_multi_vectors, sparse_entries
from fusedserve.server.responses import EmbeddingResponse, LeanRoute
from fusedserve.server.routes.infer import ENCODING_HELP, MULTI_VECTOR_HELP, Encoding, StrictRequest

router = APIRouter(prefix="/v1", tags=["openai"])


OutputName = Literal["dense", "multi_vector", "sparse"]


class EmbeddingsRequest(StrictRequest):
    input: str | list[str] | list[StrictInt] | list[list[StrictInt]] = Field(
        ..., description="a text, texts, one input's token ids, or several inputs' token ids")
    model: str | None = Field(None, description="one of the served models' ids (GET /v1/models); empty or absent: the "
                              "first embedding model")
    encoding_format: Encoding | Literal["sparse", "base64_float16"] = Field(
        "float", description=ENCODING_HELP + "; `sparse` (a sparse model's only one): each embedding as its non-zero "
        "entries `[{index, value}]`, as TEI's /embed_sparse; with output `multi_vector`: " + MULTI_VECTOR_HELP)
    output: OutputName | list[OutputName] = Field(
        "dense", description="an extension for models of several outputs (GET /v1/models lists them): `dense` (one "
        "vector per input), `multi_vector` (one per token: BGE-M3's and ColBERT models' late-interaction vectors, "
        "each embedding a [tokens, dim] list, or a string with `shape` and `dtype` in a base64 encoding), `sparse` "
        "(as encoding_format `sparse`); several (BGE-M3) from one forward, as float: each item's `embedding` (dense), "
        "`multi_vector` and `sparse_embedding`, those asked for")
    dimensions: StrictInt | None = Field(None, description="keep the first N dimensions (renormalized)")
    truncate: StrictBool = Field(True, description="cut inputs at max_seq_length tokens; false makes an over-long "
                                 "input a 413")
    user: str | None = Field(None, description="the end user's id (accepted, not used)")
    prompt_name: str | None = Field(None, description="one of the model's prompts, put before each text input; "
                                    "absent: the model's default prompt, if it has one")


class SparseValue(BaseModel):
    index: int
    value: float


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | list[int] | str | list[SparseValue] | list[list[float]] | None = None
    multi_vector: list[list[float]] | None = Field(None, description="with several outputs asked for")
    sparse_embedding: list[SparseValue] | None = Field(None, description="with several outputs asked for")
    shape: list[int] | None = Field(None, description="a base64 multi-vector's [tokens, dim]")
    dtype: Literal["float32", "float16"] | None = Field(None, description="a base64 multi-vector's value type")


class EmbeddingsUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingsUsage


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    outputs: list[str] | None = Field(None, description="a model of several outputs (BGE-M3): what it gives, "
                                      "model.api.Output's names; absent for the others")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


def _has_text(inputs: list) -> bool:
    # a prompt applies to texts; with token ids only there is nothing to put it before (accepted, as before)
    return any(isinstance(x, str) for x in inputs)


def _model(model, created: int) -> dict:
    entry = {"id": model.name, "object": "model", "created": created, "owned_by": "fusedserve"}
    outputs = model.description.outputs if model.description is not None else ()
    if "colbert" in outputs:  # a model of several outputs says which (OpenAI's clients ignore a field they lack)
        entry["outputs"] = list(outputs)
    return entry


def _inputs(data) -> list:
    if isinstance(data, str):
        return [data]
    if data and all(isinstance(x, int) for x in data):
        return [data]  # one input's token ids
    return list(data)


async def _several(body: EmbeddingsRequest, outputs: list[str], service, request: Request) -> EmbeddingResponse:
    """Several outputs of one forward (BGE-M3's: model.api's "m3"), as float."""
    if body.encoding_format != "float":
        raise Unprocessable("several outputs come as float", param="encoding_format")
    if body.dimensions is not None:
        raise Unprocessable("dimensions does not apply to several outputs", param="dimensions")
    model = service.model(body.model, "embedding")
    if not {"pooled", "colbert", "sparse"} <= set(model.description.outputs):
        raise Unprocessable(f"{model.name} gives one output a request ({', '.join(model.description.outputs)}); "
                            f"several at once come from BGE-M3", param="output")
    inputs = _inputs(body.input)
    options = TextOptions(truncate=body.truncate, prompt_name=body.prompt_name if _has_text(inputs) else None)
    deadline = Deadline.of_request(service.settings.request_timeout_s)
    prepared = await model.prepare(inputs, options, deadline=deadline)
    dense, vectors, sparse = await model.all_outputs(prepared, request, deadline)

    def items() -> list[dict]:
        entries = sparse_entries(sparse) if "sparse" in outputs else None
        out = []
        for i in range(len(prepared)):
            item = {"object": "embedding", "index": i}
            if "dense" in outputs:
                item["embedding"] = dense[i]
            if "multi_vector" in outputs:
                item["multi_vector"] = vectors[i]
            if entries is not None:
                item["sparse_embedding"] = entries[i]
            out.append(item)
        return out

    data = await asyncio.to_thread(items)
    return EmbeddingResponse({"object": "list", "data": data, "model": model.name,
                              "usage": {"prompt_tokens": prepared.tokens, "total_tokens": prepared.tokens}})


async def embeddings(body: EmbeddingsRequest, service: ServiceDep, request: Request) -> EmbeddingResponse:
    outputs = [body.output] if isinstance(body.output, str) else list(dict.fromkeys(body.output))
    if not outputs:
        raise Unprocessable("output: name at least one", param="output")
    if len(outputs) > 1:
        return await _several(body, outputs, service, request)
    output = outputs[0]
    sparse = body.encoding_format == "sparse" or output == "sparse"
    if sparse and body.encoding_format not in ("float", "sparse"):
        raise Unprocessable(f"sparse vectors come as entries; encoding_format {body.encoding_format} does not apply",
                            param="encoding_format")
    multi = output == "multi_vector"
    if body.encoding_format == "base64_float16" and not multi:
        raise Unprocessable("base64_float16 applies to multi-vectors (output multi_vector)", param="encoding_format")
    if multi and body.encoding_format not in MULTI_VECTOR_ENCODINGS:
        raise Unprocessable(f"multi-vectors come as {', '.join(MULTI_VECTOR_ENCODINGS)}, not "
                            f"{body.encoding_format}", param="encoding_format")
    model = service.model(body.model, "sparse" if sparse else "multi_vector" if multi else "embedding")
    if (sparse or multi) and body.dimensions is not None:
        raise Unprocessable(f"dimensions does not apply to {output.replace('_', '-')} vectors",
                            param="dimensions")
    model.limits.dimensions(body.dimensions)
    inputs = _inputs(body.input)
    options = TextOptions(truncate=body.truncate, prompt_name=body.prompt_name if _has_text(inputs) else None)
    if sparse:  # a SPLADE model's rows, or BGE-M3's sparse head
        deadline = Deadline.of_request(service.settings.request_timeout_s)
        prepared = await model.prepare(inputs, options, deadline=deadline)
        rows = await asyncio.to_thread(sparse_entries, await model.sparse_rows(prepared, request, deadline))
        tokens = prepared.tokens
    elif multi:
        deadline = Deadline.of_request(service.settings.request_timeout_s)
        prepared = await model.prepare(inputs, options, deadline=deadline)
        blocks = await model.token_rows(prepared, request, deadline, encoding=body.encoding_format)
        rows = await asyncio.to_thread(encode_multi_vectors, blocks, body.encoding_format)
        tokens = prepared.tokens
    else:
        result = await model.embed(inputs, options, request, normalize=True, dimensions=body.dimensions)
        rows = await model.output(result.rows, body.encoding_format, normalize=True, dimensions=body.dimensions)
        tokens = result.tokens
    items = [{"object": "embedding", "index": i, "embedding": row} if not isinstance(row, dict) else
             {"object": "embedding", "index": i, "embedding": row["data"], "shape": row["shape"], "dtype": row["dtype"]}
             for i, row in enumerate(rows)]
    return EmbeddingResponse({"object": "list", "data": items, "model": model.name,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


# the hot route parses its own body (server.responses.LeanRoute); the others are plain routes
router.add_api_route("/embeddings", embeddings, methods=["POST"], response_model=EmbeddingsResponse,
                     route_class_override=LeanRoute)


@router.get("/models", response_model=ModelList, response_model_exclude_none=True)
async def models(service: ServiceDep) -> dict:
    """Every model the server serves (one that failed to load under model_load_failure=skip is left out)."""
    service.check_ready()
    return {"object": "list", "data": [_model(m, service.created) for m in service.serving]}


@router.get("/models/{model_id:path}", response_model=Model, response_model_exclude_none=True)
async def model(model_id: str, service: ServiceDep) -> dict:
    return _model(service.model(model_id), service.created)
