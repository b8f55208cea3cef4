"""KServe v2 / Open Inference Protocol, as tritonclient speaks it: server metadata, health, model metadata,
readiness, config and statistics, and infer with a BYTES input of texts returning an FP32 [n, dim] output. Each of
the server's models is /v2/models/{its name}; infer and config serve embedding models.

The binary tensor data extension works both ways: a request whose `Inference-Header-Content-Length` header says
where its JSON ends carries each binary input's bytes after it (`parameters.binary_data_size`; BYTES elements as a
4-byte little-endian length and the bytes), and an output asked for with `parameters.binary_data: true` (or the
request's `binary_data_output`) comes back as raw little-endian float32 after the JSON, with the same header.
Request bodies may be gzip or deflate compressed (`Content-Encoding`). Errors are `{"error": "<message>"}`.

The JSON is read as Triton's parser (RapidJSON) and serde_json read it: integers are int64 (dims, as Triton reads
them), NaN and Infinity are not JSON, and no object names a key twice; each of these is a 400. A shape's element
count is checked against max_client_batch before any tensor data is read."""

from __future__ import annotations

import asyncio
import json
import math
import re
import struct
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, StrictInt, ValidationError

from fusedserve.model.api import TextOptions
from fusedserve.server.deps import ServiceDep
from fusedserve.server.errors import BadRequest, PayloadTooLarge, Unprocessable, ascii_int, clipped, quoted
from fusedserve.server.responses import EmbeddingResponse, OrjsonRoute
from fusedserve.server.service import VERSION

router = APIRouter(prefix="/v2", tags=["kserve-v2"], route_class=OrjsonRoute)

INPUT_NAME, OUTPUT_NAME = "text", "embedding"
HEADER_LENGTH = "inference-header-content-length"
EXTENSIONS = ["binary_tensor_data", "model_configuration", "statistics"]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
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


@dataclass
class Stats:
    """Per-model counters for GET /v2/models/{name}/stats (Triton's statistics extension, the parts that apply)."""

    success: int = 0
    success_ns: int = 0
    fail: int = 0
    fail_ns: int = 0
    inferences: int = 0
    last_ms: int = 0


def _stats(model) -> Stats:
    stats = getattr(model, "kserve_stats", None)
    if stats is None:
        stats = model.kserve_stats = Stats()
    return stats


@router.get("")
async def server_metadata() -> dict:
    """Server metadata: name, version, the protocol extensions served."""
    return {"name": "fusedserve", "version": VERSION, "extensions": EXTENSIONS}


@router.get("/health/live")
async def live() -> dict:
    return {"live": True}


@router.get("/health/ready")
async def ready(service: ServiceDep) -> dict:
    service.check_probe()
    return {"ready": True}


@router.get("/models/{name}")
async def metadata(name: str, service: ServiceDep) -> dict:
    """A model's metadata: an embedding model's BYTES input `text` and FP32 output `embedding` [n, dim]. A
    classifier is served on /rerank, /v1/rerank and /predict, not here: its metadata names no tensors."""
    model = service.model(name)
    if model.kind != "embedding":
        return {"name": model.name, "versions": ["1"], "platform": "pytorch", "inputs": [], "outputs": [],
                "parameters": {"kind": model.kind, "routes": "/rerank, /v1/rerank, /predict"}}
    return {
        "name": model.name, "versions": ["1"], "platform": "pytorch",
        "inputs": [{"name": INPUT_NAME, "datatype": "BYTES", "shape": [-1]}],
        "outputs": [{"name": OUTPUT_NAME, "datatype": "FP32", "shape": [-1, model.dim]}],
    }


@router.get("/models/{name}/ready")
async def model_ready(name: str, service: ServiceDep) -> dict:
    model = service.model(name)
    return {"name": model.name, "ready": True}


@router.get("/models/{name}/config")
async def model_config(name: str, service: ServiceDep) -> dict:
    """The model configuration in Triton's form (an embedding model's)."""
    model = service.model(name, "embedding")
    s = service.settings
    return {
        "name": model.name, "platform": "pytorch", "backend": "fusedserve", "version_policy": {"latest": {
            "num_versions": 1}}, "max_batch_size": s.max_client_batch,
        "input": [{"name": INPUT_NAME, "data_type": "TYPE_STRING", "dims": [-1]}],
        "output": [{"name": OUTPUT_NAME, "data_type": "TYPE_FP32", "dims": [-1, model.dim]}],
        "dynamic_batching": {"max_queue_delay_microseconds": int(s.max_wait_ms * 1000),
                             "preferred_batch_size": [s.max_batch_requests]},
        "parameters": {"max_seq_length": {"string_value": str(model.description.max_length)},
                       "normalize": {"string_value": "true"}},
    }


@router.get("/models/{name}/stats")
async def model_stats(name: str, service: ServiceDep) -> dict:
    """Inference statistics in Triton's form: successes and failures of POST .../infer with their total time."""
    model = service.model(name)
    st = _stats(model)
    zero = {"count": 0, "ns": 0}
    return {"model_stats": [{
        "name": model.name, "version": "1", "last_inference": st.last_ms, "inference_count": st.inferences,
        "execution_count": st.success, "inference_stats": {
            "success": {"count": st.success, "ns": st.success_ns}, "fail": {"count": st.fail, "ns": st.fail_ns},
            "queue": zero, "compute_input": zero, "compute_infer": zero, "compute_output": zero},
        "batch_stats": []}]}


def _flatten(data: list[Any], limit: int) -> list[Any]:
    """The elements of nested lists in order, stopping once there are more than `limit` (the shape's count: the
    rest cannot match it). Iterative: the nesting may be as deep as the JSON parser allows."""
    out: list[Any] = []
    stack = [iter(data)]
    while stack:
        for x in stack[-1]:
            if isinstance(x, list):
                stack.append(iter(x))
                break
            out.append(x)
            if len(out) > limit:
                return out
        else:
            stack.pop()
    return out


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


def shape_text(shape: Sequence[int]) -> str:
    """A client's shape as an error message repeats it, cut at 100 characters. Only the dims that reach the cut are
    written out (a shape may have millions), and none past int64 (converting a long integer to text costs time that
    grows with its square)."""
    parts: list[str] = []
    length = 0
    for d in shape:
        if length > 100:  # past the cut: the rest is not written out
            return f"[{', '.join(parts)}"[:100] + f"... ({len(shape)} dims)"
        parts.append(str(d) if INT64_MIN <= d <= INT64_MAX else "(past int64)")
        length += len(parts[-1]) + 2
    return clipped("[" + ", ".join(parts) + "]")


def element_count(name: str, shape: Sequence[int]) -> int:
    """The number of elements a tensor of this shape holds, counted in int64 as Triton counts it: a 400 for a
    negative dim or a count past int64. The product is taken a few dims at a time and stops once past int64, so no
    product grows past a few thousand bits; a zero dim means no elements, whatever the others."""
    if not shape:
        return 1
    if min(shape) < 0:
        raise BadRequest(f"input {quoted(name)} has a negative dim in shape {shape_text(shape)}")
    if max(shape) > INT64_MAX:
        raise BadRequest(f"input {quoted(name)} has a dim past int64 in shape {shape_text(shape)}")
    if 0 in shape:
        return 0
    count = 1
    for start in range(0, len(shape), 64):
        count *= math.prod(shape[start: start + 64])
        if count > INT64_MAX:
            raise BadRequest(f"input {quoted(name)} of shape {shape_text(shape)} holds more elements than int64 counts")
    return count


def deserialize_bytes(buffer: bytes, max_items: int) -> list[bytes]:
    """BYTES tensor data in the binary extension: each element a 4-byte little-endian length and that many bytes.
    A 413 once the buffer holds more than `max_items` elements (max_client_batch), read no further: four bytes make
    an empty element, so a few megabytes can hold a million."""
    out: list[bytes] = []
    offset = 0
    while offset < len(buffer):
        if len(out) == max_items:
            raise PayloadTooLarge(f"binary BYTES data holds more than {max_items} elements; the limit is {max_items} "
                                  f"(max_client_batch)")
        if offset + 4 > len(buffer):
            raise BadRequest("binary BYTES data ends inside an element's length")
        (length,) = struct.unpack_from("<I", buffer, offset)
        offset += 4
        if offset + length > len(buffer):
            raise BadRequest("binary BYTES data ends inside an element")
        out.append(buffer[offset: offset + length])
        offset += length
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


def parse_infer(raw: bytes, header_length: str | None, max_items: int) -> tuple[InferenceRequest, list[str]]:
    """The request and its texts, from JSON or JSON + binary tensor data; a 413 for a shape of more than
    `max_items` elements (max_client_batch), before any of its data is read."""
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
    if len(body.inputs) != 1 or body.inputs[0].name != INPUT_NAME or body.inputs[0].datatype != "BYTES":
        raise BadRequest(f"expected exactly one BYTES input named {INPUT_NAME!r}")
    tensor = body.inputs[0]
    count = element_count(tensor.name, tensor.shape)
    if count > max_items:
        raise PayloadTooLarge(f"shape {shape_text(tensor.shape)} holds {count} inputs; the limit is {max_items} "
                              f"(max_client_batch)")
    size = (tensor.parameters or {}).get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or size > len(binary):
            raise BadRequest(f"binary_data_size {_shown(size)} does not fit the {len(binary)} bytes after the JSON")
        try:
            texts = [t.decode("utf-8") for t in deserialize_bytes(binary[:size], max_items)]
        except UnicodeDecodeError:
            raise BadRequest("BYTES input data must be UTF-8 text") from None
    elif tensor.data is not None:
        texts = _flatten(tensor.data, count)
        if not all(isinstance(t, str) for t in texts):
            raise BadRequest("BYTES input data must be strings")
    else:
        raise BadRequest(f"input {INPUT_NAME!r} has neither data nor binary_data_size")
    if count != len(texts):
        found = f"more than {count}" if len(texts) > count else str(len(texts))
        raise BadRequest(f"shape {shape_text(tensor.shape)} does not match {found} data elements")
    return body, texts


def _read(raw: bytes, encoding: str | None, header_length: str | None, max_bytes: int,
          max_items: int) -> tuple[InferenceRequest, list[str]]:
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
    started = time.perf_counter_ns()
    model = service.model(name, "embedding")
    stats = _stats(model)
    try:
        raw, s = await request.body(), service.settings
        args = (raw, request.headers.get("content-encoding"), request.headers.get(HEADER_LENGTH), s.max_body_bytes,
                s.max_client_batch)
        # a compressed body may inflate to max_body_bytes, so it is read off the loop whatever its size
        off_loop = len(raw) > OFF_LOOP_BYTES or "content-encoding" in request.headers
        body, texts = await asyncio.to_thread(_read, *args) if off_loop else _read(*args)
        if body.outputs and any(o.name != OUTPUT_NAME for o in body.outputs):
            raise BadRequest(f"the only output is {OUTPUT_NAME!r}")
        normalize = _flag(body.parameters, "normalize", True)
        binary = _flag(body.parameters, "binary_data_output", False)
        for output in body.outputs or ():
            binary = _flag(output.parameters, "binary_data", binary)
        embeddings = (await model.embed(texts, TextOptions(), request, normalize=normalize)).rows
    except Exception:
        stats.fail += 1
        stats.fail_ns += time.perf_counter_ns() - started
        raise
    stats.success += 1
    stats.inferences += len(texts)
    stats.success_ns += time.perf_counter_ns() - started
    stats.last_ms = int(time.time() * 1000)
    output: dict[str, Any] = {"name": OUTPUT_NAME, "datatype": "FP32", "shape": [len(texts), model.dim]}
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
