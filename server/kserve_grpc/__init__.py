"""The KServe v2 (Open Inference Protocol) gRPC service on its own port (`grpc_port`): ServerLive, ServerReady,
ModelReady, ServerMetadata, ModelMetadata and ModelInfer, as `tritonclient.grpc` and KServe's clients call them, and
Triton's ModelConfig and ModelStatistics (tritonclient.grpc's get_model_config and get_inference_statistics).

It runs in the HTTP server's event loop (grpc.aio) and goes through the same service: the same model lookup and
readiness, the same tokenizer, limits and batcher, the same API keys (`authorization: Bearer <key>` metadata; the
two server probes open unless auth_probes), and the same metrics, each call counted as
`fusedserve_requests_total{route="/inference.GRPCInferenceService/<Method>"}` with the HTTP status its outcome maps
to, so the dashboards' error rates count gRPC too. An error is a gRPC status with the message the HTTP routes give.

What the methods answer is the HTTP KServe routes' (server.kserve_common): the extensions, a model's metadata, its
configuration and statistics (the messages filled from the same dicts; one set of counters per model, which both
ports' infer calls count into), and the reading of ModelInfer's inputs: `text` (BYTES), or `input_ids` (INT64 or
INT32 [n, L]) with an optional right-padded `attention_mask`, in the typed contents field or raw. The answer is
`embedding`, FP32 [n, dim], raw little-endian in raw_output_contents; parameter `normalize` (bool, default true) as
on the HTTP route.

The messages are built from predict_v2.proto's descriptor in a pool of their own, so this module never clashes
with another copy of the protocol (tritonclient's) imported into the same process.

The port has HTTP's limits, from the same settings (`server_options`). gRPC's core accepts connections and buffers
messages outside Python, so each limit is one its core enforces, or one that stops the core from buffering: every
method is served as stream-unary, so the handler runs when the call's headers arrive, checks the key at once and only
then asks for the message, under the request's deadline counted from the call's start; a unary handler would get
control only once the whole message had arrived, however long the client took to send it, key or not. A call waiting
to receive its message holds one of a few receive slots, so the messages buffered at once stay within
RECEIVE_BUDGET_BYTES; a stream nobody reads from is held to HTTP/2's initial flow-control window."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc
import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from google.protobuf.message import DecodeError

from fusedserve.model.api import TextOptions
from fusedserve.server import kserve_common as common
from fusedserve.server.deps import key_matches
from fusedserve.server.config import Settings
from fusedserve.server.errors import BadRequest, NotFound, ServiceError, Unauthorized, Unavailable, quoted
from fusedserve.server.heap import LARGE_BODY_BYTES, HeapTrimmer
from fusedserve.server.kserve_common import OUTPUT, InputTensor, read_rows
from fusedserve.server.kserve_grpc.descriptor import SERIALIZED
from fusedserve.server.observability import CLIENT_GONE_STATUS, CURRENT, RequestRecord, request_id
from fusedserve.server.service import Service

log = logging.getLogger("fusedserve")

SERVICE = "inference.GRPCInferenceService"

_pool = descriptor_pool.DescriptorPool()
_pool.Add(descriptor_pb2.FileDescriptorProto.FromString(SERIALIZED))


def _message(name: str):
    return message_factory.GetMessageClass(_pool.FindMessageTypeByName(f"inference.{name}"))


# (method, request, response, a probe: open without an API key unless auth_probes)
METHODS = [(m, _message(f"{m}Request"), _message(f"{m}Response"), m in ("ServerLive", "ServerReady"))
           for m in ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer",
                     "ModelConfig", "ModelStatistics")]
_Response = dict((m, response) for m, _, response, _ in METHODS)

# an error's HTTP status -> the gRPC code that says the same (gRPC's own HTTP mapping where it has one)
CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED, 404: grpc.StatusCode.NOT_FOUND,
         408: grpc.StatusCode.DEADLINE_EXCEEDED,
         413: grpc.StatusCode.INVALID_ARGUMENT, 422: grpc.StatusCode.INVALID_ARGUMENT,
         429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE,
         504: grpc.StatusCode.DEADLINE_EXCEEDED}

# the typed contents field each datatype an input may have is read from
_TYPED = {"BYTES": "bytes_contents", "INT64": "int64_contents", "INT32": "int_contents"}

# HTTP/2 streams open at once on one connection (nginx allows 128, Go's HTTP/2 server 250; gRPC's core no limit)
STREAMS_PER_CONNECTION = 100
# a connection is closed after this long, its calls in flight given request_timeout_s to finish: clients spread
# over the replicas again, and no connection lives forever
MAX_CONNECTION_AGE_S = 1800
# keepalive pings a client may send: no more often than this while no data flows, at most PING_STRIKES too early
# before the connection is closed (gRPC's core answers every ping otherwise)
MIN_PING_INTERVAL_S = 10
PING_STRIKES = 2
# messages being received at once hold at most about this many bytes: max_body_bytes each, so
# RECEIVE_BUDGET_BYTES // max_body_bytes calls receive at a time and the others wait (under their deadline)
RECEIVE_BUDGET_BYTES = 64 * 1024 * 1024


def server_options(settings: Settings) -> list[tuple[str, int]]:
    """gRPC core's channel arguments for the port: HTTP's limits from the same settings."""
    s = settings
    return [
        ("grpc.max_receive_message_length", s.max_body_bytes),  # refused by the core, naming both sizes
        ("grpc.max_send_message_length", -1),
        ("grpc.so_reuseport", 1),
        ("grpc.max_allowed_incoming_connections", s.max_connections),
        ("grpc.server_handshake_timeout_ms", int(s.header_timeout_s * 1000)),
        ("grpc.max_connection_idle_ms", int(s.idle_timeout_s * 1000)),
        ("grpc.max_connection_age_ms", MAX_CONNECTION_AGE_S * 1000),
        ("grpc.max_connection_age_grace_ms", int((s.request_timeout_s + s.request_grace_s) * 1000)),
        ("grpc.max_concurrent_streams", STREAMS_PER_CONNECTION),
        # flow-control windows stay at HTTP/2's initial 64 KiB unless a message is being read (then the core opens
        # the stream's window to the message's size): BDP probing grows every stream's window, read or not, and let
        # a client park megabytes on each stream that no handler had asked for
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_S * 1000),
        ("grpc.http2.max_ping_strikes", PING_STRIKES),
    ]


class _NotReceived(ServiceError):
    status, type = 408, "request_timeout"


class KServeGrpc:
    """The gRPC server: start() binds `host:grpc_port` in the running event loop, stop() lets calls in flight
    finish."""

    def __init__(self, service: Service, host: str, port: int) -> None:
        self.service, self.host, self.port = service, host, port
        s = service.settings
        self.keys = [k.encode() for k in s.api_keys]
        self.open_probes = not s.auth_probes
        self.timeout_s = s.request_timeout_s
        self.receiving = asyncio.Semaphore(max(1, RECEIVE_BUDGET_BYTES // s.max_body_bytes))
        self.heap = HeapTrimmer()
        # calls past max_connections at once are refused by the core (RESOURCE_EXHAUSTED), as HTTP's connections past
        # it are answered 503: one HTTP/1.1 connection carries one request at a time
        self.server = grpc.aio.server(options=server_options(s), maximum_concurrent_rpcs=s.max_connections)
        # stream-unary, the message read by the handler itself (raw bytes, parsed there): see the module's docstring
        handlers = {name: grpc.stream_unary_rpc_method_handler(
            self._observed(name, getattr(self, f"_{name}"), request, probe),
            request_deserializer=None, response_serializer=response.SerializeToString)
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

    # ---- one call: its record, its key, its message, its metrics, its error as a gRPC status -----------------------
    def _observed(self, method: str, handler: Callable[..., Awaitable], request_type, probe: bool):
        metrics, route = self.service.metrics, f"/{SERVICE}/{method}"

        async def call(messages, context: grpc.aio.ServicerContext):
            started = time.monotonic()
            metadata = context.invocation_metadata() or ()
            given = dict(metadata)
            record = RequestRecord(request_id(given.get("x-request-id")), started)
            token = CURRENT.set(record)
            status, size = 500, 0
            try:
                if sum(key == "authorization" for key, _ in metadata) > 1:  # HTTP refuses two Authorization headers
                    raise BadRequest("more than one authorization metadata entry")
                if self.keys and not (probe and self.open_probes):
                    self._authorize(given.get("authorization", ""))
                raw = await self._receive(messages, started)
                size = len(raw)
                try:
                    request = request_type.FromString(raw)
                except DecodeError:
                    raise BadRequest(f"the message is not a valid {request_type.DESCRIPTOR.name}") from None
                response = await handler(request)
                status = 200
                return response
            except ServiceError as exc:
                status = exc.status
                await context.abort(CODES.get(exc.status, grpc.StatusCode.INTERNAL), exc.message)
            except asyncio.CancelledError:  # the client went away or its deadline passed: its inputs were dropped
                status = CLIENT_GONE_STATUS
                log.info("client disconnected: gRPC %s after %.2fs, request id %s", method, time.monotonic() - started,
                         record.id)
                raise
            except Exception:  # a bug: logged here, never a traceback to the client
                log.exception("unhandled error in gRPC %s", method)
                await context.abort(grpc.StatusCode.INTERNAL, "internal error")
            finally:
                CURRENT.reset(token)
                metrics.requests.labels(record.model, route, str(status)).inc()
                metrics.request_duration.labels(record.model, route).observe(time.monotonic() - started)
                if size >= LARGE_BODY_BYTES:  # as after a large HTTP body: the freed heap back to the OS
                    self.heap.after_large_request()
        return call

    async def _receive(self, messages, started: float) -> bytes:
        """The call's one message, read once a receive slot is free, within request_timeout_s of the call's start."""
        try:
            async with asyncio.timeout(started + self.timeout_s - time.monotonic()):
                async with self.receiving:
                    return await anext(messages)
        except TimeoutError:
            raise _NotReceived(f"message not received within {self.timeout_s:g}s (request_timeout_s)") from None
        except StopAsyncIteration:
            raise BadRequest("the call carried no message") from None

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
        return json_format.ParseDict(common.server_metadata(), _Response["ServerMetadata"]())

    async def _ModelMetadata(self, request):
        _check_version(request.version)
        # a classifier's `parameters` (where it is served) has no field in the message
        return json_format.ParseDict(common.model_metadata(self.service.model(request.name)),
                                     _Response["ModelMetadata"](), ignore_unknown_fields=True)

    async def _ModelConfig(self, request):
        _check_version(request.version)
        config = common.model_config(self.service.model(request.name, "embedding"), self.service.settings)
        out = _Response["ModelConfig"]()
        json_format.ParseDict(config, out.config)
        return out

    async def _ModelStatistics(self, request):
        _check_version(request.version)
        return json_format.ParseDict(common.model_stats(self.service, request.name), _Response["ModelStatistics"]())

    async def _ModelInfer(self, request):
        _check_version(request.model_version)
        model = self.service.model(request.model_name, "embedding")
        with common.stats_of(model).counted() as inference:
            rows = read_rows(_inputs(request), self.service.settings.max_client_batch)
            if any(o.name != OUTPUT for o in request.outputs):
                raise BadRequest(f"the only output is {OUTPUT!r}")
            normalize = _bool(request.parameters, "normalize", True)
            embeddings = (await model.embed(rows, TextOptions(), None, normalize=normalize)).rows
            inference.inputs = len(rows)
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


def _inputs(request) -> list[InputTensor]:
    """The request's inputs, each raw or typed: the raw form for every input or for none, as the protocol says."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise BadRequest(f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs")
    out = []
    for i, tensor in enumerate(request.inputs):
        if raw and tensor.HasField("contents"):  # Triton refuses both too: which would it mean?
            raise BadRequest(f"input {quoted(tensor.name)} has both contents and raw_input_contents; send one")
        field = _TYPED.get(tensor.datatype)  # another datatype is refused by name before its elements are read
        values = () if raw or field is None else getattr(tensor.contents, field)
        out.append(InputTensor(tensor.name, tensor.datatype, tensor.shape, raw=raw[i] if raw else None,
                               values=None if raw else values))
    return out
