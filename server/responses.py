"""The embedding routes' JSON: orjson writes the [n, dim] float32 matrix straight from numpy, and reads the
request bodies.

Serializing embeddings through pydantic and the standard json module makes a Python float object and its repr per
element, on the event loop, which every request of the process shares: one server process is bound by its host CPU
long before its GPU (docs/performance.md), so that per-element work, not the model, would set its requests/s. orjson
writes a float32 array without a Python object per element, each value as the shortest decimal that reads back as
the same float32 (the model's own precision). The routes keep their pydantic response models for the OpenAPI
schema; returning a Response skips FastAPI's re-validation of the output.

Request bodies go through orjson too (`OrjsonRoute`): a token-id request is a long list of integers, whose decode by
the standard json module is Python work on the same event loop. orjson.JSONDecodeError subclasses
json.JSONDecodeError, so a malformed body is still a `json_invalid` validation error (the app answers it 400). orjson
differs from json in two places, both still 4xx: a lone surrogate escape ("\\ud800") is invalid JSON (400), and an
integer beyond 64 bits reads as a float, which an int field then refuses (422).
"""

from __future__ import annotations

import asyncio
import inspect
import typing
from collections.abc import Callable
from typing import Any

import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from fusedserve.server.deps import get_service
from fusedserve.server.observability import ClientGone


class EmbeddingResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


async def off_the_loop(make: Callable[[], Any]) -> Response:
    """A JSON answer that grows with every token (/tokenize, /embed_all: megabytes), built and serialized on a worker
    thread: on the event loop it held every other request of the process for seconds."""
    body = await asyncio.to_thread(lambda: orjson.dumps(make(), option=orjson.OPT_SERIALIZE_NUMPY))
    return Response(body, media_type="application/json")


class OrjsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = orjson.loads(await self.body())
        return self._json


class OrjsonRoute(APIRoute):
    """An APIRoute whose handler parses the JSON body with orjson (FastAPI's custom-Request pattern)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            return await handler(OrjsonRequest(request.scope, request.receive))

        return route


class LeanRoute(APIRoute):
    """For the hot routes (POST /infer, POST /v1/embeddings and every POST of the TEI router): the handler parses and
    validates the body itself and calls the endpoint as endpoint(body, service, request), skipping FastAPI's per-request
    dependency solving, validation wrappers and response checks. That machinery is Python work per request on the
    event loop, and one server process is bound by its CPU, so every request it skips is throughput gained (the
    serving numbers are in docs/performance.md). The route stays an APIRoute (OpenAPI schema, routing, the app's
    middleware and exception handlers); the body is handled as FastAPI's strict default does it: JSON when the
    content type is application/json or application/*+json (else, a missing type included, the raw bytes, which
    then fail validation), a malformed body is a json_invalid error, an empty one a missing body, and pydantic's
    errors are reported under "body" like FastAPI's (the app turns them into 400 / 422); a client that goes away
    mid-body is ClientGone (server.observability: a 499, answered with nothing), where FastAPI would answer a 400 to
    nobody (an over-long body never gets here: BodyLimit answers 413)."""

    def get_route_handler(self):
        params = list(inspect.signature(self.endpoint).parameters)
        if params != ["body", "service", "request"]:
            raise TypeError(f"LeanRoute endpoints take (body, service, request); {self.endpoint.__name__} takes {params}")
        model = typing.get_type_hints(self.endpoint)["body"]
        endpoint = self.endpoint

        async def route(request: Request) -> Response:
            try:
                raw = await request.body()
            except ClientDisconnect:
                raise ClientGone("client disconnected while sending the body") from None
            if not raw:
                raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required",
                                               "input": None}])
            data: Any = raw
            if _is_json(request.headers.get("content-type")):
                try:
                    data = orjson.loads(raw)
                except orjson.JSONDecodeError as exc:
                    raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos),
                                                   "msg": "JSON decode error", "input": {},
                                                   "ctx": {"error": exc.msg}}]) from None
            try:
                body = model.model_validate(data)
            except ValidationError as exc:
                raise RequestValidationError([{**e, "loc": ("body", *e["loc"])}
                                              for e in exc.errors(include_url=False)]) from None
            return await endpoint(body, await get_service(request), request)

        return route


def _is_json(content_type: str | None) -> bool:
    if not content_type:  # FastAPI's strict_content_type (its default): no type, no JSON
        return False
    kind = content_type.partition(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))
