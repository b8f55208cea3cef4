"""text-embeddings-inference's API, with its request and response shapes: POST /embed, /embed_all, /similarity,
/tokenize, /decode, GET /health, and POST / (which, as on a TEI server serving an embedding model, embeds; it also
answers TEI's sentence-similarity shape, the one huggingface_hub's InferenceClient.sentence_similarity sends).
Errors come in TEI's shape, `{"error", "error_type"}` (server.errors). TEI serves one model and its requests name
none: on a server of several, the embedding routes go to the first embedding model, /tokenize and /decode to the
first model."""

from __future__ import annotations

import asyncio
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field, RootModel, StrictBool

from fusedserve.server.deps import ServiceDep
from fusedserve.server.errors import Unprocessable
from fusedserve.server.model_service import INLINE_TOKENIZE_CHARS, ModelService
from fusedserve.server.responses import EmbeddingResponse, LeanRoute
from fusedserve.server.routes.infer import ENCODING_HELP, Encoding

router = APIRouter(tags=["text-embeddings-inference"], route_class=LeanRoute)

Direction = Literal["right", "left", "Right", "Left"]
Inputs = str | list[int] | list[str | list[int]]

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
    dimensions: int | None = Field(None, description="keep the first N dimensions (renormalized when normalize)")
    encoding_format: Encoding = Field("float", description=ENCODING_HELP)


class EmbedAllRequest(BaseModel):
    inputs: Inputs = Field(..., description=INPUTS_HELP)
    truncate: StrictBool | None = Field(None, description=TRUNCATE_HELP)
    truncation_direction: Direction = Field("right", description=DIRECTION_HELP)
    prompt_name: str | None = Field(None, description=PROMPT_HELP)


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
    ids: list[int] | list[list[int]] = Field(..., description="one input's token ids, or a list of them")
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


def _direction(value: str) -> str:
    return value.lower()


async def _token_ids(model: ModelService, items: list[str | list[int]], *, truncate: bool, direction: str,
                     prompt_name: str | None) -> list[list[int]]:
    """Texts tokenized (with the prompt), token-id inputs validated; both cut to max_seq_length, in input order."""
    model.check_ready()
    model.check_count(len(items))
    texts = [x for x in items if isinstance(x, str)]
    if prompt_name is not None and len(texts) < len(items):
        raise Unprocessable("prompt_name applies to texts, not to token-id inputs", param="prompt_name")
    texts = model.apply_prompt(texts, prompt_name)
    if len(texts) == len(items):
        return await model.tokenize(texts, truncate=truncate, direction=direction)
    tokenized = iter(await model.tokenize(texts, truncate=truncate, direction=direction) if texts else [])
    given = iter(model.validate_ids([x for x in items if not isinstance(x, str)], truncate, direction))
    return [next(tokenized) if isinstance(x, str) else next(given) for x in items]


def _truncate(value: bool | None) -> bool:
    return True if value is None else value


async def _embed(body: EmbedRequest, service, request: Request) -> EmbeddingResponse:
    model = service.model(None, "embedding")
    model.check_dimensions(body.dimensions)
    ids = await _token_ids(model, _items(body.inputs), truncate=_truncate(body.truncate),
                           direction=_direction(body.truncation_direction), prompt_name=body.prompt_name)
    result = await model.embed_ids(ids, normalize=body.normalize, request=request)
    rows = await model.output(result.embeddings, body.encoding_format, normalize=body.normalize,
                                dimensions=body.dimensions)
    return EmbeddingResponse(rows)


async def _similarity(body: SimilarityRequest, service, request: Request) -> EmbeddingResponse:
    model = service.model(None, "embedding")
    params = body.parameters or SimilarityParameters()
    texts = [body.inputs.source_sentence, *body.inputs.sentences]
    ids = await _token_ids(model, texts, truncate=_truncate(params.truncate),
                           direction=_direction(params.truncation_direction), prompt_name=params.prompt_name)
    result = await model.embed_ids(ids, normalize=True, request=request)
    source, others = result.embeddings[0], result.embeddings[1:]
    return EmbeddingResponse(others @ source)  # cosine similarity of unit vectors


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


@router.post("/embed_all", response_model=list[list[list[float]]])
async def embed_all(body: EmbedAllRequest, service: ServiceDep, request: Request) -> EmbeddingResponse:
    """Per-token hidden states of each input, special tokens included: `[[[float]]]` (inputs x tokens x dim)."""
    model = service.model(None, "embedding")
    ids = await _token_ids(model, _items(body.inputs), truncate=_truncate(body.truncate),
                           direction=_direction(body.truncation_direction), prompt_name=body.prompt_name)
    return EmbeddingResponse(await model.embed_tokens(ids))


def _byte_offsets(text: str):
    """Character offset -> UTF-8 byte offset of `text` (TEI reports byte offsets)."""
    if text.isascii():
        return lambda i: i
    ends = [0]
    for ch in text:
        ends.append(ends[-1] + len(ch.encode("utf-8")))
    return ends.__getitem__


def _tokens(tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[dict]]:
    out = []
    for text, encoding in zip(texts, tokenizer.untruncated.encode_batch(texts, add_special_tokens=add_special_tokens)):
        to_bytes = _byte_offsets(text)
        tokens = []
        for token_id, token, special, (start, stop) in zip(encoding.ids, encoding.tokens,
                                                           encoding.special_tokens_mask, encoding.offsets):
            if special:
                tokens.append({"id": token_id, "text": token, "special": True, "start": None, "stop": None})
            else:
                tokens.append({"id": token_id, "text": text[start:stop], "special": False,
                               "start": to_bytes(start), "stop": to_bytes(stop)})
        out.append(tokens)
    return out


@router.post("/tokenize", response_model=list[list[SimpleToken]])
async def tokenize(body: TokenizeRequest, service: ServiceDep, request: Request) -> EmbeddingResponse:
    """Each text's tokens: `id`, `text` (the input's text it covers; the token itself for special tokens),
    `special`, and `start` / `stop` (UTF-8 byte offsets in the input, null for special tokens)."""
    model = service.model()
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    model.check_count(len(texts))
    texts = model.apply_prompt(texts, body.prompt_name)
    pipeline = model.embedder.pipeline
    if pipeline is not None and pipeline.do_lower_case:  # the ids /embed runs (offsets then index the lower-cased text)
        texts = [t.lower() for t in texts]
    tokenizer = model.embedder.tokenizer
    if sum(map(len, texts)) <= INLINE_TOKENIZE_CHARS:
        return EmbeddingResponse(_tokens(tokenizer, texts, body.add_special_tokens))
    return EmbeddingResponse(await asyncio.to_thread(_tokens, tokenizer, texts, body.add_special_tokens))


@router.post("/decode", response_model=list[str])
async def decode(body: DecodeRequest, service: ServiceDep, request: Request) -> EmbeddingResponse:
    """The text of each token-id list."""
    model = service.model()
    rows = [body.ids] if body.ids and all(isinstance(x, int) for x in body.ids) else body.ids
    model.check_count(len(rows))
    tokenizer = model.embedder.tokenizer.untruncated
    vocab = tokenizer.get_vocab_size()
    for i, row in enumerate(rows):
        if row and (min(row) < 0 or max(row) >= vocab):
            bad = next(t for t in row if not 0 <= t < vocab)
            raise Unprocessable(f"input {i} has token id {bad} outside the vocabulary [0, {vocab})", param="ids")
    return EmbeddingResponse(tokenizer.decode_batch(rows, skip_special_tokens=body.skip_special_tokens))


async def health(service: ServiceDep) -> Response:
    """200 (empty) once the model is loaded and warmed up; 503 while it loads, after a failed start, or while the
    server drains."""
    service.check_probe()
    return Response(status_code=200)


router.add_api_route("/health", health, methods=["GET"], route_class_override=APIRoute, response_class=Response,
                     responses={200: {"description": "ready", "content": None},
                                503: {"description": "loading, failed or draining"}})
