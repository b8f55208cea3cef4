"""The KServe v2 (Open Inference Protocol) gRPC service on its own port (`grpc_port`): ServerLive, ServerReady,
ModelReady, ServerMetadata, ModelMetadata and ModelInfer, as `tritonclient.grpc` and KServe's clients call them.

It runs in the HTTP server's event loop (grpc.aio) and goes through the same service: the same model lookup and
readiness, the same tokenizer, limits and batcher, the same API keys (`authorization: Bearer <key>` metadata; the
two server probes open unless auth_probes), and the same metrics, each call counted as
`fusedserve_requests_total{route="/inference.GRPCInferenceService/<Method>"}` with the HTTP status its outcome maps
to, so the dashboards' error rates count gRPC too. An error is a gRPC status with the message the HTTP routes give.

ModelInfer takes one of two inputs: `text`, BYTES [n] (texts), or `input_ids`, INT64 or INT32 [n, L] (token ids
with the model's special tokens, as /tokenize gives them), with an optional `attention_mask` of the same shape
whose ones come first in each row (right padding): a row is its ids up to the mask's sum. Either in the typed
contents field or raw. The answer is `embedding`, FP32 [n, dim], raw little-endian in raw_output_contents;
parameter `normalize` (bool, default true) as on the HTTP KServe route.

The messages are built from predict_v2.proto's descriptor in a pool of their own, so this module never clashes
with another copy of the protocol (tritonclient's) imported into the same process."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable

import grpc
import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from fusedserve.model.api import TextOptions
from fusedserve.server.deps import key_matches
from fusedserve.server.errors import BadRequest, NotFound, ServiceError, Unauthorized, Unavailable, quoted
from fusedserve.server.kserve_grpc.descriptor import SERIALIZED
from fusedserve.server.observability import CURRENT, RequestRecord, request_id
from fusedserve.server.routes.kserve import deserialize_bytes
from fusedserve.server.service import VERSION, Service

log = logging.getLogger("fusedserve")

SERVICE = "inference.GRPCInferenceService"
TEXT, IDS, MASK, OUTPUT = "text", "input_ids", "attention_mask", "embedding"
EXTENSIONS = ["token_ids"]

_pool = descriptor_pool.DescriptorPool()
_pool.Add(descriptor_pb2.FileDescriptorProto.FromString(SERIALIZED))


def _message(name: str):
    return message_factory.GetMessageClass(_pool.FindMessageTypeByName(f"inference.{name}"))


# (method, request, response, a probe: open without an API key unless auth_probes)
METHODS = [(m, _message(f"{m}Request"), _message(f"{m}Response"), m in ("ServerLive", "ServerReady"))
           for m in ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer")]
_Response = dict((m, response) for m, _, response, _ in METHODS)

# an error's HTTP status -> the gRPC code that says the same (gRPC's own HTTP mapping where it has one)
CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED, 404: grpc.StatusCode.NOT_FOUND,
         408: grpc.StatusCode.DEADLINE_EXCEEDED,
         413: grpc.StatusCode.INVALID_ARGUMENT, 422: grpc.StatusCode.INVALID_ARGUMENT,
         429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE,
         504: grpc.StatusCode.DEADLINE_EXCEEDED}

# element sizes of the datatypes ModelInfer reads raw
_RAW = {"INT64": np.dtype("<i8"), "INT32": np.dtype("<i4")}


class KServeGrpc:
    """The gRPC server: start() binds `host:grpc_port` in the running event loop, stop() lets calls in flight
    finish."""

    def __init__(self, service: Service, host: str, port: int) -> None:
        self.service, self.host, self.port = service, host, port
        s = service.settings
        self.keys = [k.encode() for k in s.api_keys]
        self.open_probes = not s.auth_probes
        # a message over the HTTP body limit is refused by gRPC itself (RESOURCE_EXHAUSTED, naming both sizes)
        self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", s.max_body_bytes),
                                               ("grpc.max_send_message_length", -1), ("grpc.so_reuseport", 1)])
        handlers = {name: grpc.unary_unary_rpc_method_handler(
            self._observed(name, getattr(self, f"_{name}"), probe),
            request_deserializer=request.FromString, response_serializer=response.SerializeToString)
            for name, request, response, probe in METHODS}
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))

    async def start(self) -> None:
        try:
            self.bound = self.server.add_insecure_port(f"{self.host}:{self.port}")
        except RuntimeError as exc:
            raise RuntimeError(f"gRPC cannot listen on {self.host}:{self.port} (grpc_port): {exc}") from None
        await self.server.start()
        log.info("KServe v2 gRPC on %s:%d", self.host, self.bound)

    async def stop(self, grace_s: float) -> None:
        await self.server.stop(grace_s)

    # ---- one call: its record, its key, its metrics, its error as a gRPC status --------------------------------
    def _observed(self, method: str, handler: Callable[..., Awaitable], probe: bool):
        metrics, route = self.service.metrics, f"/{SERVICE}/{method}"

        async def call(request, context: grpc.aio.ServicerContext):
            started = time.monotonic()
            given = dict(context.invocation_metadata() or ())
            record = RequestRecord(request_id(given.get("x-request-id")), started)
            token = CURRENT.set(record)
            status = 500
            try:
                if self.keys and not (probe and self.open_probes):
                    self._authorize(given.get("authorization", ""))
                response = await handler(request)
                status = 200
                return response
            except ServiceError as exc:
                status = exc.status
                await context.abort(CODES.get(exc.status, grpc.StatusCode.INTERNAL), exc.message)
            except asyncio.CancelledError:  # the client went away or its deadline passed: its inputs were dropped
                status = 499
                raise
            except Exception:  # a bug: logged here, never a traceback to the client
                log.exception("unhandled error in gRPC %s", method)
                await context.abort(grpc.StatusCode.INTERNAL, "internal error")
            finally:
                CURRENT.reset(token)
                metrics.requests.labels(record.model, route, str(status)).inc()
                metrics.request_duration.labels(record.model, route).observe(time.monotonic() - started)
        return call

    def _authorize(self, header: str) -> None:
        scheme, _, given = header.partition(" ")
        given_key = given.strip().encode() if scheme.lower() == "bearer" else b""
        if not key_matches(self.keys, given_key):
            raise Unauthorized("missing API key (authorization: Bearer <key>)" if not given_key else
                               "invalid API key")

    # ---- the methods -------------------------------------------------------------------------------------------
    async def _ServerLive(self, request):
        return _Response["ServerLive"](live=True)

    async def _ServerReady(self, request):
        try:
            self.service.check_probe()
        except Unavailable:
            return _Response["ServerReady"](ready=False)
        return _Response["ServerReady"](ready=True)

    async def _ModelReady(self, request):
        _check_version(request.version)
        try:
            self.service.model(request.name)
        except Unavailable:
            return _Response["ModelReady"](ready=False)
        return _Response["ModelReady"](ready=True)

    async def _ServerMetadata(self, request):
        return _Response["ServerMetadata"](name="fusedserve", version=VERSION, extensions=EXTENSIONS)

    async def _ModelMetadata(self, request):
        _check_version(request.version)
        model = self.service.model(request.name)
        out = _Response["ModelMetadata"](name=model.name, versions=["1"], platform="pytorch")
        if model.kind == "embedding":  # a classifier is served over HTTP only (/rerank, /predict): no tensors
            out.inputs.add(name=TEXT, datatype="BYTES", shape=[-1])
            out.inputs.add(name=IDS, datatype="INT64", shape=[-1, -1])
            out.inputs.add(name=MASK, datatype="INT64", shape=[-1, -1])
            out.outputs.add(name=OUTPUT, datatype="FP32", shape=[-1, model.dim])
        return out

    async def _ModelInfer(self, request):
        _check_version(request.model_version)
        model = self.service.model(request.model_name, "embedding")
        inputs = _inputs(request)
        if any(o.name != OUTPUT for o in request.outputs):
            raise BadRequest(f"the only output is {OUTPUT!r}")
        normalize = _bool(request.parameters, "normalize", True)
        if TEXT in inputs:
            if set(inputs) != {TEXT}:
                raise BadRequest(f"input {TEXT!r} comes alone (texts, or {IDS!r} with {MASK!r})")
            rows = _texts(*inputs[TEXT])
        elif IDS in inputs:
            if set(inputs) - {IDS, MASK}:
                raise BadRequest(f"inputs are {TEXT!r}, or {IDS!r} with an optional {MASK!r}")
            rows = _id_rows(inputs[IDS], inputs.get(MASK))
        else:
            raise BadRequest(f"expected an input named {TEXT!r} (BYTES) or {IDS!r} (INT64)")
        embeddings = (await model.embed(rows, TextOptions(), None, normalize=normalize)).rows
        out = _Response["ModelInfer"](model_name=model.name, model_version="1", id=request.id)
        out.outputs.add(name=OUTPUT, datatype="FP32", shape=list(embeddings.shape))
        out.raw_output_contents.append(np.ascontiguousarray(embeddings, dtype="<f4").tobytes())
        return out


def _check_version(version: str) -> None:
    if version not in ("", "1"):
        raise NotFound(f"model version {quoted(version)} is not served; every model here has version '1'")


def _bool(parameters, name: str, default: bool) -> bool:
    if name not in parameters:
        return default
    p = parameters[name]
    if p.WhichOneof("parameter_choice") != "bool_param":
        raise BadRequest(f"parameter {name!r} must be a boolean")
    return p.bool_param


def _inputs(request) -> dict[str, tuple]:
    """{name: (tensor, its raw bytes or None)}: the raw form for every input or for none, as the protocol says."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise BadRequest(f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs")
    out: dict[str, tuple] = {}
    for i, tensor in enumerate(request.inputs):
        if tensor.name in out:
            raise BadRequest(f"input {tensor.name!r} given twice")
        if any(d < 0 for d in tensor.shape):
            raise BadRequest(f"input {tensor.name!r} has a negative dimension in shape {list(tensor.shape)}")
        out[tensor.name] = (tensor, raw[i] if raw else None)
    return out


def _texts(tensor, raw: bytes | None) -> list[str]:
    if tensor.datatype != "BYTES" or len(tensor.shape) != 1:
        raise BadRequest(f"input {TEXT!r} is BYTES of shape [n], not {tensor.datatype} {list(tensor.shape)}")
    items = deserialize_bytes(raw) if raw is not None else list(tensor.contents.bytes_contents)
    if len(items) != math.prod(tensor.shape):
        raise BadRequest(f"shape {list(tensor.shape)} does not match {len(items)} BYTES elements")
    try:
        return [b.decode("utf-8") for b in items]
    except UnicodeDecodeError:
        raise BadRequest("BYTES input data must be UTF-8 text") from None


def _integers(name: str, tensor, raw: bytes | None) -> np.ndarray:
    """An INT64 / INT32 input as an int64 array of its shape ([L] is one row)."""
    if tensor.datatype not in _RAW or len(tensor.shape) not in (1, 2):
        raise BadRequest(f"input {name!r} is INT64 or INT32 of shape [n, L], not {tensor.datatype} "
                         f"{list(tensor.shape)}")
    if raw is not None:
        dtype = _RAW[tensor.datatype]
        if len(raw) != math.prod(tensor.shape) * dtype.itemsize:
            raise BadRequest(f"input {name!r}: {len(raw)} raw bytes for shape {list(tensor.shape)} of "
                             f"{tensor.datatype}")
        values = np.frombuffer(raw, dtype=dtype)
    else:
        c = tensor.contents
        values = np.asarray(c.int64_contents if tensor.datatype == "INT64" else c.int_contents, dtype=np.int64)
        if values.size != math.prod(tensor.shape):
            raise BadRequest(f"input {name!r}: {values.size} values for shape {list(tensor.shape)}")
    return values.astype(np.int64, copy=False).reshape(-1, tensor.shape[-1])


def _id_rows(ids: tuple, mask: tuple | None) -> list[list[int]]:
    block = _integers(IDS, *ids)
    if mask is None:
        return block.tolist()
    m = _integers(MASK, *mask)
    if m.shape != block.shape:
        raise BadRequest(f"{MASK!r} has shape {list(m.shape)}, {IDS!r} {list(block.shape)}")
    if not np.isin(m, (0, 1)).all():
        raise BadRequest(f"{MASK!r} holds values other than 0 and 1")
    lengths = m.sum(axis=1)
    # right padding only: each row's ones first, then zeros (a left-padded row's ids would be read from the pad)
    if (m != (np.arange(m.shape[1]) < lengths[:, None])).any():
        raise BadRequest(f"{MASK!r} must be ones then zeros in each row (right padding)")
    return [row[:n] for row, n in zip(block.tolist(), lengths.tolist())]
