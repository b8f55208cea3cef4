"""Classifier routes: text-embeddings-inference's `POST /rerank` and `POST /predict`, and the Cohere/Jina-style
`POST /v1/rerank`. Pairs are tokenized as pairs (the model's template, token types, longest_first truncation),
exactly as sentence-transformers' CrossEncoder does; scores go through the model's activation (sigmoid for one
label, softmax otherwise, or what its config names) unless `raw_scores` asks for the logits. TEI's routes have no
model field: they go to the server's first classifier; `/v1/rerank` takes a `model` (absent: that same one)."""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, StrictBool, StrictInt

from fusedserve.model.api import TextOptions, scores
from fusedserve.server.deps import ServiceDep
from fusedserve.server.errors import Unprocessable
from fusedserve.server.model_service import ModelService
from fusedserve.server.service import Service

router = APIRouter(tags=["classification"])


def _classifier(service: Service, route: str, *, rerank: bool, name: str | None = None) -> ModelService:
    """The classifier the request names, or the server's first; a re-rank needs one with one output label."""
    model = service.model(name, "classifier")
    labels = model.description.labels
    if rerank and len(labels) != 1:
        raise Unprocessable(f"{route} needs a re-ranker (one output label); {model.name} has "
                            f"{len(labels)} labels ({', '.join(labels)}): use /predict")
    return model


async def _scores(model: ModelService, pairs: list[tuple[str, str]] | list[str], truncate: bool, raw: bool,
                  request: Request) -> tuple[np.ndarray, int]:
    """(the scores, one row per input; the tokens the model ran, special tokens included)."""
    result = await model.embed(pairs, TextOptions(truncate=truncate), request)
    return (result.rows if raw else scores(result.rows, model.description.activation)), result.tokens


class RerankRequest(BaseModel):
    query: str
    texts: list[str] = Field(..., min_length=1)
    raw_scores: StrictBool = False
    return_text: StrictBool = False
    truncate: StrictBool = Field(False, description="cut pairs at max_seq_length tokens (longest first); false makes "
                                 "an over-long pair a 413")
    truncation_direction: str = Field("Right", pattern="^(Right|right)$",
                                      description="only Right: text-embeddings-inference's default")


@router.post("/rerank")
async def rerank(body: RerankRequest, service: ServiceDep, request: Request) -> list[dict]:
    """text-embeddings-inference's re-rank: each text scored against the query, best first."""
    model = _classifier(service, "/rerank", rerank=True)
    scores, _ = await _scores(model, [(body.query, t) for t in body.texts], body.truncate, body.raw_scores, request)
    order = np.argsort(-scores[:, 0], kind="stable")
    return [{"index": int(i), "score": float(scores[i, 0]), **({"text": body.texts[i]} if body.return_text else {})}
            for i in order]


class Document(BaseModel):
    text: str


class CohereRerankRequest(BaseModel):
    model: str | None = Field(None, description="one of the server's classifiers; absent: the first")
    query: str
    documents: list[str | Document] = Field(..., min_length=1)
    top_n: StrictInt | None = Field(None, ge=1)
    return_documents: StrictBool = False
    truncate: StrictBool = True


@router.post("/v1/rerank")
async def cohere_rerank(body: CohereRerankRequest, service: ServiceDep, request: Request) -> dict:
    """Cohere / Jina-style re-rank: `results` best first, `relevance_score` in [0, 1] (the model's activation)."""
    model = _classifier(service, "/v1/rerank", rerank=True, name=body.model)
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
    scores, tokens = await _scores(model, [(body.query, t) for t in texts], body.truncate, False, request)
    order = np.argsort(-scores[:, 0], kind="stable")[: body.top_n]
    # every pair ran, whatever top_n keeps: the usage counts them all
    return {"model": model.name,
            "results": [{"index": int(i), "relevance_score": float(scores[i, 0]),
                         **({"document": {"text": texts[i]}} if body.return_documents else {})} for i in order],
            "usage": {"total_tokens": tokens}}


class PredictRequest(BaseModel):
    inputs: str | list[str] | list[list[str]] = Field(..., description="a text, a pair [a, b], or a batch of "
                                                                          "texts or pairs")
    raw_scores: StrictBool = False
    truncate: StrictBool = False


def _as_inputs(value) -> tuple[list, bool]:
    """(the inputs as a batch, whether the request sent one input)."""
    if isinstance(value, str):
        return [value], True
    if value and all(isinstance(v, str) for v in value):
        if len(value) == 2:  # text-embeddings-inference reads a two-text list as one pair
            return [tuple(value)], True
        return list(value), False
    batch = []
    for i, item in enumerate(value):
        if isinstance(item, str) or len(item) not in (1, 2):
            raise Unprocessable(f"inputs[{i}]: a pair is a list of two texts (or one text in a list)")
        batch.append(tuple(item) if len(item) == 2 else item[0])
    if {isinstance(b, str) for b in batch} == {True, False}:
        raise Unprocessable("inputs: a batch holds texts or pairs, not both")
    return batch, False


@router.post("/predict")
async def predict(body: PredictRequest, service: ServiceDep, request: Request) -> list:
    """text-embeddings-inference's classify: per input, every label with its score, best first."""
    model = _classifier(service, "/predict", rerank=False)
    batch, single = _as_inputs(body.inputs)
    scores, _ = await _scores(model, batch, body.truncate, body.raw_scores, request)
    labels = model.description.labels
    rows = [[{"label": labels[j], "score": float(row[j])} for j in np.argsort(-row, kind="stable")] for row in scores]
    return rows[0] if single else rows
