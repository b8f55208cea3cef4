"""KServe v2 / Open Inference Protocol, as tritonclient speaks it: server metadata, health, model metadata,
readiness, config and statistics, and infer, of texts (BYTES `text`) or token ids (INT64/INT32 `input_ids` with an
optional right-padded `attention_mask`), returning an FP32 [n, dim] output. Each of the server's models is
/v2/models/{its name}; infer and config serve embedding models. What these answer and how the inputs are read is
server.kserve_common's, shared with the gRPC service (server.kserve_grpc): both ports give one answer.

The binary tensor data extension works both ways: a request whose `Inference-Header-Content-Length` header says
where its JSON ends carries each binary input's bytes after it, one input after another in the order of `inputs`
(`parameters.binary_data_size`; little-endian elements, BYTES elements as a 4-byte little-endian length and the
bytes), and an output asked for with `parameters.binary_data: true` (or the request's `binary_data_output`) comes
back as raw little-endian float32 after the JSON, with the same header. Request bodies may be gzip or deflate
compressed (`Content-Encoding`). Errors are `{"error": "<message>"}`.

The JSON is read as Triton's parser (RapidJSON) and serde_json read it: integers are int64 (dims, as Triton reads
them), NaN and Infinity are not JSON, and no object names a key twice; each of these is a 400. A shape's element
count is checked against max_client_batch before any tensor data is read."""

from __future__ import annotations

import asyncio
import json
import math
import re
import zlib
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, StrictInt, ValidationError

from fusedserve.model.api import TextOptions
from fusedserve.server import kserve_common as common
from fusedserve.server.deps import ServiceDep
from fusedserve.server.errors import BadRequest, PayloadTooLarge, Unprocessable, ascii_int, clipped, quoted
from fusedserve.server.kserve_common import INT64_MAX, INT64_MIN, OUTPUT, InputTensor, read_rows
from fusedserve.server.responses import EmbeddingResponse, OrjsonRoute

router = APIRouter(prefix="/v2", tags=["kserve-v2"], route_class=OrjsonRoute)

HEADER_LENGTH = "inference-header-content-length"
# A body past this size is read on a worker thread: the JSON hooks below run Python code per number and per object,
# so a megabytes-long body costs a fraction of a second; off the event loop it holds no other request meanwhile.
OFF_LOOP_BYTES = 64 * 1024


class TensorInput(BaseModel):
    name: str
    shape: list[StrictInt]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class RequestedOutput(BaseModel):
    name: str
    parameters: dict[str, Any] | None = None


class InferenceRequest(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[TensorInput]
    outputs: list[RequestedOutput] | None = None


@router.get("")
async def server_metadata() -> dict:
    """Server metadata: name, version, the protocol extensions served."""
    return common.server_metadata()


@router.get("/health/live")
async def live() -> dict:
    return {"live": True}


@router.get("/health/ready")
async def ready(service: ServiceDep) -> dict:
    service.check_probe()
    return {"ready": True}


@router.get("/models/stats")  # before /models/{name}: Triton's path for every model's statistics
async def every_model_stats(service: ServiceDep) -> dict:
    """Inference statistics of every served model, in Triton's form."""
    return common.model_stats(service, "")


@router.get("/models/{name}")
async def metadata(name: str, service: ServiceDep) -> dict:
    """A model's metadata: an embedding model's inputs (BYTES `text`, or INT64 `input_ids` with an optional
    `attention_mask`) and its FP32 output `embedding` [n, dim]. A classifier is served on /rerank, /v1/rerank and
    /predict, not here: its metadata names no tensors."""
    return common.model_metadata(service.model(name))


@router.get("/models/{name}/ready")
async def model_ready(name: str, service: ServiceDep) -> dict:
    model = service.model(name)
    return {"name": model.name, "ready": True}


@router.get("/models/{name}/config")
async def model_config(name: str, service: ServiceDep) -> dict:
    """The model configuration in Triton's form (an embedding model's)."""
    return common.model_config(service.model(name, "embedding"), service.settings)


@router.get("/models/{name}/stats")
async def model_stats(name: str, service: ServiceDep) -> dict:
    """Inference statistics in Triton's form: successes and failures of the model's infer calls (HTTP and gRPC)
    with their total time."""
    return common.model_stats(service, name)


def _inlined_schema(model: type[BaseModel]) -> dict:
    """The model's JSON schema with its $defs inlined (an OpenAPI requestBody cannot reach local $defs)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node):
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)


def _decompress(raw: bytes, encoding: str | None, limit: int) -> bytes:
    encoding = (encoding or "").strip().lower()  # content codings are case-insensitive (RFC 9110, 8.4.1)
    if not encoding or encoding == "identity":
        return raw
    if encoding not in ("gzip", "deflate"):
        raise BadRequest(f"unsupported Content-Encoding {quoted(encoding)} (gzip, deflate)")
    inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    try:
        out = inflater.decompress(raw, limit + 1)
    except zlib.error as exc:
        raise BadRequest(f"body is not valid {encoding} data: {exc}") from None
    if len(out) > limit:
        raise PayloadTooLarge(f"decompressed request body over {limit} bytes")
    if not inflater.eof or inflater.unused_data:  # a cut-off stream, or bytes after its end
        raise BadRequest(f"body is not one complete {encoding} stream")
    return out


def _int64(literal: str) -> int:
    """An integer literal, refused past int64 from its digits alone: the integer is never built (the time to convert
    a long literal and to multiply by it grows with the square of its length)."""
    if len(literal) > 20 or not INT64_MIN <= (value := int(literal)) <= INT64_MAX:  # 20: a sign and 19 digits
        raise BadRequest(f"integer {clipped(literal)} is past int64")
    return value


def _finite(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise BadRequest(f"number {clipped(literal)} is past float64")
    return value


def _constant(name: str) -> Any:
    raise BadRequest(f"{name} is not a JSON number")


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise BadRequest(f"key {quoted(key)} appears twice in one JSON object")
            seen.add(key)
    return out


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def load_json(raw: bytes) -> Any:
    """A request's JSON as Triton's RapidJSON reads it: an integer past int64, NaN or Infinity, a number past float64
    or a key twice in one object is a 400; text that is not JSON (or not UTF-8) a 422, as a schema problem is."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Unprocessable(f"the JSON is not UTF-8 text (byte {exc.start})") from None
    try:
        value = json.loads(text, parse_int=_int64, parse_float=_finite, parse_constant=_constant,
                           object_pairs_hook=_object)
    except json.JSONDecodeError as exc:
        raise Unprocessable(f"invalid JSON: {exc.msg} at character {exc.pos}") from None
    except RecursionError:
        raise Unprocessable("invalid JSON: nested too deeply") from None
    # json keeps a lone surrogate escape as a str that cannot be encoded again; orjson refuses one, and is asked
    # only where such an escape may be
    if _SURROGATE_ESCAPE.search(text):
        try:
            orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise Unprocessable(f"invalid JSON: {exc}") from None
    return value


def _shown(value: Any) -> str:
    """A JSON value as an error message repeats it: a string or number cut at 100 characters, a list or object
    named only."""
    if isinstance(value, (list, dict)):
        return "a list" if isinstance(value, list) else "an object"
    return quoted(value) if isinstance(value, str) else clipped(repr(value))


def parse_infer(raw: bytes, header_length: str | None,
                max_items: int) -> tuple[InferenceRequest, list[str] | list[list[int]]]:
    """The request, and the texts or token-id rows its inputs hold, from JSON or JSON + binary tensor data; a 413
    for a shape of more than `max_items` inputs (max_client_batch), before any of its data is read."""
    binary = b""
    if header_length is not None:
        if not ascii_int(header_length) or int(header_length) > len(raw):
            raise BadRequest(f"Inference-Header-Content-Length {quoted(header_length)} does not fit a "
                             f"{len(raw)}-byte body")
        raw, binary = raw[: int(header_length)], raw[int(header_length):]
    try:
        body = InferenceRequest.model_validate(load_json(raw))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
        raise Unprocessable(clipped(problems, limit=300)) from None
    tensors, offset = [], 0
    for tensor in body.inputs:
        size = (tensor.parameters or {}).get("binary_data_size")
        chunk = None
        if size is not None:
            left = len(binary) - offset
            if not isinstance(size, int) or isinstance(size, bool) or size < 0 or size > left:
                raise BadRequest(f"binary_data_size {_shown(size)} of input {quoted(tensor.name)} does not fit the "
                                 f"{left} bytes left after the JSON")
            chunk, offset = binary[offset: offset + size], offset + size
        tensors.append(InputTensor(tensor.name, tensor.datatype, tensor.shape, raw=chunk, data=tensor.data))
    return body, read_rows(tensors, max_items)


def _read(raw: bytes, encoding: str | None, header_length: str | None, max_bytes: int,
          max_items: int) -> tuple[InferenceRequest, list[str] | list[list[int]]]:
    return parse_infer(_decompress(raw, encoding, max_bytes), header_length, max_items)


def _flag(parameters: dict[str, Any] | None, name: str, default: bool) -> bool:
    value = (parameters or {}).get(name, default)
    if not isinstance(value, bool):
        raise BadRequest(f"parameter {name!r} must be a boolean, not {_shown(value)}")
    return value


@router.post("/models/{name}/infer", openapi_extra={"requestBody": {"required": True, "content": {
    "application/json": {"schema": _inlined_schema(InferenceRequest)},
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}})
async def infer(name: str, service: ServiceDep, request: Request) -> Response:
    # Parsed by hand: Open Inference Protocol clients do not all send a JSON content type, and the binary
    # extension's bodies are JSON followed by raw bytes.
    model = service.model(name, "embedding")
    with common.stats_of(model).counted() as inference:
        raw, s = await request.body(), service.settings
        args = (raw, request.headers.get("content-encoding"), request.headers.get(HEADER_LENGTH), s.max_body_bytes,
                s.max_client_batch)
        # a compressed body may inflate to max_body_bytes, so it is read off the loop whatever its size
        off_loop = len(raw) > OFF_LOOP_BYTES or "content-encoding" in request.headers
        body, rows = await asyncio.to_thread(_read, *args) if off_loop else _read(*args)
        if body.outputs and any(o.name != OUTPUT for o in body.outputs):
            raise BadRequest(f"the only output is {OUTPUT!r}")
        normalize = _flag(body.parameters, "normalize", True)
        binary = _flag(body.parameters, "binary_data_output", False)
        for output in body.outputs or ():
            binary = _flag(output.parameters, "binary_data", binary)
        embeddings = (await model.embed(rows, TextOptions(), request, normalize=normalize)).rows
        inference.inputs = len(rows)
    output: dict[str, Any] = {"name": OUTPUT, "datatype": "FP32", "shape": [len(rows), model.dim]}
    response: dict[str, Any] = {"model_name": model.name, "model_version": "1", "outputs": [output]}
    if body.id is not None:
        response["id"] = body.id
    if not binary:
        output["data"] = embeddings.ravel()
        return EmbeddingResponse(response)
    data = np.ascontiguousarray(embeddings, dtype="<f4").tobytes()
    output["parameters"] = {"binary_data_size": len(data)}
    header = orjson.dumps(response)
    return Response(header + data, media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(len(header))})
