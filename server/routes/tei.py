"""text-embeddings-inference's API, with its request and response shapes: POST /embed, /embed_all, /embed_sparse
(a SPLADE model's sparse vectors), /similarity, /tokenize, /decode, GET /health, and POST / (which, as on a TEI server serving an embedding model, embeds; it also
answers TEI's sentence-similarity shape, the one huggingface_hub's InferenceClient.sentence_similarity sends).
Errors come in TEI's shape, `{"error", "error_type"}` (server.errors). TEI serves one model and its requests name
none: on a server of several, the embedding routes go to the first embedding model, /tokenize and /decode to the
first model."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field, RootModel, StrictBool, StrictInt

from fusedserve.model.api import TextOptions
from fusedserve.server.deadline import Deadline
from fusedserve.server.deps import ServiceDep
from fusedserve.server.quantize import encode_multi_vectors, sparse_entries
from fusedserve.server.responses import EmbeddingResponse, LeanRoute, off_the_loop
from fusedserve.server.routes.infer import (ENCODING_HELP, MULTI_VECTOR_HELP, EncodedVectors, Encoding,
                                           MultiVectorEncoding)

router = APIRouter(tags=["text-embeddings-inference"], route_class=LeanRoute)

Direction = Literal["right", "left", "Right", "Left"]
Inputs = str | list[StrictInt] | list[str | list[StrictInt]]

INPUTS_HELP = "a text, one input's token ids, or a list of texts and token-id lists"
TRUNCATE_HELP = "cut inputs over max_seq_length tokens (default true); false makes an over-long input a 413"
DIRECTION_HELP = "which end of an over-long input is cut (first and last special tokens are kept)"
PROMPT_HELP = "a prompt of the model's sentence-transformers configuration to put before each text (422 for a " \
              "model without prompts)"


class EmbedRequest(BaseModel):
    inputs: Inputs = Field(..., description=INPUTS_HELP)
    normalize: StrictBool = Field(True, description="L2-normalize each embedding")
    truncate: StrictBool | None = Field(None, description=TRUNCATE_HELP)
    truncation_direction: Direction = Field("right", description=DIRECTION_HELP)
    prompt_name: str | None = Field(None, description=PROMPT_HELP)
    dimensions: StrictInt | None = Field(None, description="keep the first N dimensions (renormalized when normalize)")
    encoding_format: Encoding = Field("float", description=ENCODING_HELP)


class EmbedAllRequest(BaseModel):
    inputs: Inputs = Field(..., description=INPUTS_HELP)
    truncate: StrictBool | None = Field(None, description=TRUNCATE_HELP)
    truncation_direction: Direction = Field("right", description=DIRECTION_HELP)
    prompt_name: str | None = Field(None, description=PROMPT_HELP)
    encoding_format: MultiVectorEncoding = Field("float", description=MULTI_VECTOR_HELP)


class EmbedSparseRequest(BaseModel):
    inputs: Inputs = Field(..., description=INPUTS_HELP)
    truncate: StrictBool | None = Field(None, description=TRUNCATE_HELP)
    truncation_direction: Direction = Field("right", description=DIRECTION_HELP)
    prompt_name: str | None = Field(None, description=PROMPT_HELP)


class SparseValue(BaseModel):
    index: int = Field(..., description="the vocabulary entry (token id)")
    value: float


class SimilarityInput(BaseModel):
    source_sentence: str
    sentences: list[str]


class SimilarityParameters(BaseModel):
    truncate: StrictBool | None = Field(None, description=TRUNCATE_HELP)
    truncation_direction: Direction = Field("right", description=DIRECTION_HELP)
    prompt_name: str | None = Field(None, description=PROMPT_HELP)


class SimilarityRequest(BaseModel):
    inputs: SimilarityInput
    parameters: SimilarityParameters | None = None


class RootRequest(RootModel[SimilarityRequest | EmbedRequest]):
    """POST /: TEI's embed request, or its sentence-similarity request."""


class TokenizeRequest(BaseModel):
    inputs: str | list[str] = Field(..., description="a text or a list of texts")
    add_special_tokens: StrictBool = Field(True, description="add the model's special tokens ([CLS], [SEP])")
    prompt_name: str | None = Field(None, description=PROMPT_HELP)


class DecodeRequest(BaseModel):
    ids: list[StrictInt] | list[list[StrictInt]] = Field(..., description="one input's token ids, or a list of them")
    skip_special_tokens: StrictBool = Field(True, description="leave special tokens out of the text")


class SimpleToken(BaseModel):
    id: int
    text: str
    special: bool
    start: int | None = Field(None, description="UTF-8 byte offset in the input (null for special tokens)")
    stop: int | None = Field(None, description="UTF-8 byte offset of the token's end")


Embeddings = list[list[float]] | list[list[int]] | list[str]


def _items(inputs: Inputs) -> list[str | list[int]]:
    if isinstance(inputs, str):
        return [inputs]
    if inputs and all(isinstance(x, int) for x in inputs):
        return [inputs]  # one input's token ids
    return list(inputs)


def _options(truncate: bool | None, direction: str, prompt_name: str | None) -> TextOptions:
    return TextOptions(truncate=True if truncate is None else truncate, direction=direction.lower(),
                       prompt_name=prompt_name)


async def _embed(body: EmbedRequest, service, request: Request) -> EmbeddingResponse:
    model = service.model(None, "embedding")
    model.limits.dimensions(body.dimensions)
    result = await model.embed(_items(body.inputs), _options(body.truncate, body.truncation_direction,
                                                             body.prompt_name), request,
                               normalize=body.normalize, dimensions=body.dimensions)
    rows = await model.output(result.rows, body.encoding_format, normalize=body.normalize,
                              dimensions=body.dimensions)
    return EmbeddingResponse(rows)


async def _similarity(body: SimilarityRequest, service, request: Request) -> EmbeddingResponse:
    model = service.model(None, "embedding")
    params = body.parameters or SimilarityParameters()
    texts = [body.inputs.source_sentence, *body.inputs.sentences]
    result = await model.embed(texts, _options(params.truncate, params.truncation_direction, params.prompt_name),
                               request, normalize=True)
    unit = result.rows
    return EmbeddingResponse(unit[1:] @ unit[0])  # cosine similarity of unit vectors


@router.post("/embed", response_model=Embeddings)
async def embed(body: EmbedRequest, service: ServiceDep, request: Request) -> EmbeddingResponse:
    """One embedding per input: `[[float]]` (or the requested output type's rows)."""
    return await _embed(body, service, request)


@router.post("/", response_model=Embeddings | list[float])
async def root(body: RootRequest, service: ServiceDep, request: Request) -> EmbeddingResponse:
    """TEI's default route: embeds (as /embed); a sentence-similarity request (`inputs.source_sentence`,
    `inputs.sentences`) gets the cosine similarity of each sentence to the source (as /similarity)."""
    if isinstance(body.root, SimilarityRequest):
        return await _similarity(body.root, service, request)
    return await _embed(body.root, service, request)


@router.post("/similarity", response_model=list[float])
async def similarity(body: SimilarityRequest, service: ServiceDep, request: Request) -> EmbeddingResponse:
    """Cosine similarity of each of `inputs.sentences` to `inputs.source_sentence`."""
    return await _similarity(body, service, request)


@router.post("/embed_all", response_model=list[list[list[float]]] | list[EncodedVectors])
async def embed_all(body: EmbedAllRequest, service: ServiceDep, request: Request) -> Response:
    """Per-token rows of each input: `[[[float]]]` (inputs x tokens x dim): the hidden states, special tokens
    included, or a multi-vector model's vectors (BGE-M3, ColBERT); with a base64 `encoding_format`, per input
    `{shape, dtype, data}`."""
    model = service.model(None, "tokens")
    rows = await model.prepare(_items(body.inputs), _options(body.truncate, body.truncation_direction,
                                                             body.prompt_name))
    blocks = await model.token_rows(rows, request, encoding=body.encoding_format)
    return await off_the_loop(lambda: encode_multi_vectors(blocks, body.encoding_format))


@router.post("/embed_sparse", response_model=list[list[SparseValue]])
async def embed_sparse(body: EmbedSparseRequest, service: ServiceDep, request: Request) -> Response:
    """A sparse (SPLADE) model's vectors: per input, its non-zero entries `[{index, value}]` in index order (422 for
    a dense embedding model)."""
    model = service.model(None, "sparse")
    deadline = Deadline.of_request(service.settings.request_timeout_s)
    rows = await model.prepare(_items(body.inputs), _options(body.truncate, body.truncation_direction,
                                                             body.prompt_name), deadline=deadline)
    block = await model.sparse_rows(rows, request, deadline)
    return await off_the_loop(lambda: sparse_entries(block))


@router.post("/tokenize", response_model=list[list[SimpleToken]])
async def tokenize(body: TokenizeRequest, service: ServiceDep, request: Request) -> Response:
    """Each text's tokens: `id`, `text` (the input's text it covers; the token itself for special tokens),
    `special`, and `start` / `stop` (UTF-8 byte offsets in the input, null for special tokens)."""
    model = service.model()
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    rows = await model.prepare(texts, TextOptions(prompt_name=body.prompt_name, special_tokens=body.add_special_tokens,
                                                  details=True, max_tokens=service.settings.max_batch_tokens))
    return await off_the_loop(lambda: [[{"id": t.id, "text": t.text, "special": t.special, "start": t.start,
                                         "stop": t.stop} for t in tokens] for tokens in rows.details])


@router.post("/decode", response_model=list[str])
async def decode(body: DecodeRequest, service: ServiceDep, request: Request) -> EmbeddingResponse:
    """The text of each token-id list."""
    model = service.model()
    rows = [body.ids] if body.ids and all(isinstance(x, int) for x in body.ids) else body.ids
    return EmbeddingResponse(model.decode(rows, body.skip_special_tokens))


async def health(service: ServiceDep) -> Response:
    """200 (empty) once the model is loaded and warmed up; 503 while it loads, after a failed start, or while the
    server drains."""
    service.check_probe()
    return Response(status_code=200)


router.add_api_route("/health", health, methods=["GET"], route_class_override=APIRoute, response_class=Response,
                     responses={200: {"description": "ready", "content": None},
                                503: {"description": "loading, failed or draining"}})
