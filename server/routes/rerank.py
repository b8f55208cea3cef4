"""Re-rank and classifier routes: text-embeddings-inference's `POST /rerank` and `POST /predict`, and the
Cohere/Jina-style `POST /v1/rerank`.

A cross-encoder scores pairs, tokenized as pairs (the model's template, token types, longest_first truncation)
exactly as sentence-transformers' CrossEncoder does; scores go through the model's activation (sigmoid for one
label, softmax otherwise, or what its config names) unless `raw_scores` asks for the logits. A late-interaction model
scores by MaxSim over its multi-vectors, the query's and each text's from one forward: a ColBERT model as PyLate's
colbert_scores (the sum over the query's vectors of the largest dot product with the text's; the query encoded as a
query, the texts as documents), BGE-M3 as FlagEmbedding's compute_score (that sum over the query's vector count), or
with `weights` FlagEmbedding's weighted combination of its dense, sparse and multi-vector scores. TEI's routes have
no model field: they go to the server's first re-ranker; `/v1/rerank` takes a `model` (absent: that same one)."""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, StrictBool, StrictInt

from fusedserve.model.api import Rows, TextOptions, scores
from fusedserve.server.deps import ServiceDep
from fusedserve.server.errors import Unprocessable
from fusedserve.server.model_service import ModelService
from fusedserve.server.quantize import SparseRow
from fusedserve.server.service import Service

router = APIRouter(tags=["classification"])


def _classifier(service: Service, route: str, *, rerank: bool, name: str | None = None) -> ModelService:
    """The classifier the request names, or the server's first; a re-rank needs one with one output label, or a
    late-interaction model (multi-vectors: ColBERT, BGE-M3)."""
    model = service.model(name, "reranker" if rerank else "classifier")
    labels = model.description.labels
    if rerank and model.kind == "classifier" and len(labels) != 1:
        raise Unprocessable(f"{route} needs a re-ranker (one output label); {model.name} has "
                            f"{len(labels)} labels ({', '.join(labels)}): use /predict")
    return model


async def _scores(model: ModelService, pairs: list[tuple[str, str]] | list[str], truncate: bool, raw: bool,
                  request: Request) -> tuple[np.ndarray, int]:
    """(the scores, one row per input; the tokens the model ran, special tokens included)."""
    result = await model.embed(pairs, TextOptions(truncate=truncate), request)
    return (result.rows if raw else scores(result.rows, model.description.activation)), result.tokens


class Weights(BaseModel):
    """BGE-M3's weighted score, FlagEmbedding's compute_score: (dense * s_dense + sparse * s_sparse + colbert *
    s_colbert) / (dense + sparse + colbert)."""

    dense: float = Field(0.0, ge=0)
    sparse: float = Field(0.0, ge=0)
    colbert: float = Field(0.0, ge=0)


WEIGHTS_HELP = ("BGE-M3 only: score by the weighted combination of its dense, sparse and multi-vector scores "
                "(FlagEmbedding's compute_score, e.g. {dense: 0.4, sparse: 0.2, colbert: 0.4}); absent: MaxSim alone")


async def _late_scores(model: ModelService, query: str, texts: list[str], truncate: bool, weights: Weights | None,
                       request: Request) -> tuple[np.ndarray, int]:
    """A late-interaction model's scores of `texts` against `query` (see the module's docstring) and the tokens
    its forwards ran."""
    colbert = model.description.text is not None and model.description.text.colbert is not None
    if weights is not None and colbert:
        raise Unprocessable(f"weights apply to BGE-M3's outputs; {model.name} scores by MaxSim alone",
                            param="weights")
    if weights is not None and weights.dense + weights.sparse + weights.colbert <= 0:
        raise Unprocessable("weights: at least one weight above 0", param="weights")
    if colbert:  # the query as a query, the texts as documents (PyLate's markers and lengths), in one forward
        query_rows = await model.prepare([query], TextOptions(truncate=truncate, prompt_name="query"))
        text_rows = await model.prepare(texts, TextOptions(truncate=truncate, prompt_name="document"))
        rows = Rows.gather([(query_rows, 0)] + [(text_rows, i) for i in range(len(texts))])
    else:
        rows = await model.prepare([query, *texts], TextOptions(truncate=truncate))
    if weights is None:
        vectors = await model.token_rows(rows, request)
    else:  # BGE-M3's three outputs from one forward
        dense, vectors, sparse = await model.all_outputs(rows, request)
    q, scores = vectors[0], np.array([maxsim(vectors[0], d) for d in vectors[1:]], dtype=np.float32)
    if not colbert:  # FlagEmbedding's colbert_score: the sum over the query's vectors' count
        scores /= max(len(q), 1)
    if weights is not None:
        lexical = np.array([lexical_match(sparse[0], s) for s in sparse[1:]], dtype=np.float32)
        scores = (weights.dense * (dense[1:] @ dense[0]) + weights.sparse * lexical + weights.colbert * scores) / \
            (weights.dense + weights.sparse + weights.colbert)
    return scores.astype(np.float32)[:, None], rows.tokens


def maxsim(query: np.ndarray, text: np.ndarray) -> float:
    """Late interaction: the sum over the query's vectors of the largest dot product with the text's vectors."""
    if not len(query) or not len(text):
        return 0.0
    return float((query @ text.T).max(axis=1).sum(dtype=np.float64))


def lexical_match(query: SparseRow, text: SparseRow) -> float:
    """FlagEmbedding's compute_lexical_matching_score: the sum of the weight products of the ids both hold."""
    _, in_query, in_text = np.intersect1d(query.indices, text.indices, assume_unique=True, return_indices=True)
    return float(np.dot(query.values[in_query].astype(np.float64), text.values[in_text]))


class RerankRequest(BaseModel):
    query: str
    texts: list[str] = Field(..., min_length=1)
    raw_scores: StrictBool = False
    return_text: StrictBool = False
    truncate: StrictBool = Field(False, description="cut pairs at max_seq_length tokens (longest first); false makes "
                                 "an over-long pair a 413")
    truncation_direction: str = Field("Right", pattern="^(Right|right)$",
                                      description="only Right: text-embeddings-inference's default")
    weights: Weights | None = Field(None, description=WEIGHTS_HELP)


@router.post("/rerank")
async def rerank(body: RerankRequest, service: ServiceDep, request: Request) -> list[dict]:
    """text-embeddings-inference's re-rank: each text scored against the query, best first (a late-interaction
    model's MaxSim scores are raw: raw_scores changes nothing)."""
    model = _classifier(service, "/rerank", rerank=True)
    if model.kind != "classifier":
        scores, _ = await _late_scores(model, body.query, body.texts, body.truncate, body.weights, request)
    elif body.weights is not None:
        raise Unprocessable(f"weights apply to BGE-M3's outputs; {model.name} is a cross-encoder", param="weights")
    else:
        scores, _ = await _scores(model, [(body.query, t) for t in body.texts], body.truncate, body.raw_scores,
                                  request)
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
    weights: Weights | None = Field(None, description=WEIGHTS_HELP)


@router.post("/v1/rerank")
async def cohere_rerank(body: CohereRerankRequest, service: ServiceDep, request: Request) -> dict:
    """Cohere / Jina-style re-rank: `results` best first; `relevance_score` in [0, 1] (a cross-encoder's
    activation), or a late-interaction model's MaxSim score as it is."""
    model = _classifier(service, "/v1/rerank", rerank=True, name=body.model)
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
    if model.kind != "classifier":
        scores, tokens = await _late_scores(model, body.query, texts, body.truncate, body.weights, request)
    elif body.weights is not None:
        raise Unprocessable(f"weights apply to BGE-M3's outputs; {model.name} is a cross-encoder", param="weights")
    else:
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
