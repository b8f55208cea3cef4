"""App factory: routes, one error mapping, the middleware (CORS, request observation, API keys, the body-size
limit), the offline API docs, and the lifespan (start loading the model in the background and serve at once; on
shutdown refuse new work and drain the queue)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from contextlib import asynccontextmanager
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from starlette._utils import get_route_path
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fusedserve.server import frontend, workers
from fusedserve.server.config import Settings
from fusedserve.server.deps import key_matches
from fusedserve.server.heap import LARGE_ANSWER_BYTES, LARGE_BODY_BYTES, HeapTrimmer, fix_malloc_thresholds
from fusedserve.server.errors import ServiceError, ascii_int, error_response, service_error_response
from fusedserve.server.observability import (CLIENT_GONE_STATUS, CURRENT, TIMING_HEADERS, ClientGone, RequestRecord,
                                             request_id)
from fusedserve.server.protocol import OVER_CAPACITY
from fusedserve.server.responses import LeanRoute
from fusedserve.server.routes import admin, health, infer, kserve, openai, rerank, tei
from fusedserve.server.frontend import FrontendService
from fusedserve.server.service import VERSION, Service

log = logging.getLogger("fusedserve")


# what one request's headers may hold (431 beyond), as front proxies bound them (nginx: 8 KiB lines, 32 KiB in
# all; hyper, which text-embeddings-inference runs on: 100 headers)
MAX_HEADERS, MAX_HEADER_BYTES = 100, 32 * 1024


class HeaderLimits:
    """Pure ASGI middleware, before anything reads the request: at most MAX_HEADERS headers of MAX_HEADER_BYTES in
    all (431); one Authorization header (400: the API-key and admin checks must read the same one); one
    Content-Length of ASCII digits (400), not over max_body_bytes (413). A request the connection layer marked as
    arriving past max_connections (server.protocol) is answered 503 and its connection closed, unless it is a probe."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope.get(OVER_CAPACITY) and scope["path"] not in PROBE_PATHS:
            response = error_response(scope["path"], 503, "overloaded", "too many open connections; retry shortly",
                                      headers={"Retry-After": "1", "Connection": "close"})
            return await response(scope, receive, send)
        headers = scope.get("headers") or ()
        size, authorizations, declared = 0, 0, []
        for key, value in headers:  # one pass: this runs on every request
            size += len(key) + len(value)
            if key == b"authorization":
                authorizations += 1
            elif key == b"content-length":
                declared.append(value)
        if len(headers) > MAX_HEADERS or size > MAX_HEADER_BYTES:
            return await _reject(scope, send, 431, "headers_too_large",
                                 f"request headers over {MAX_HEADERS} fields or {MAX_HEADER_BYTES} bytes")
        if authorizations > 1:
            return await _reject(scope, send, 400, "invalid_request", "more than one Authorization header")
        if declared and (len(declared) > 1 or not ascii_int(declared[0])):
            return await _reject(scope, send, 400, "invalid_request", "Content-Length is not one number")
        if declared and int(declared[0]) > self.max_bytes:
            return await _reject(scope, send, 413, "payload_too_large", f"request body over {self.max_bytes} bytes")
        await self.app(scope, receive, send)


class BodyLimit:
    """Pure ASGI middleware after the API-key check: the body, declared or streamed (chunked too), read here up to
    max_body_bytes (413 beyond) and handed on whole, so no route's body parser turns an over-long body into another
    status (left to FastAPI, a chunked one is a 400 on the routes that parse their body as a model). A body not
    received within timeout_s (request_timeout_s) is a 408. A large body's memory is given back once it is answered
    (heap: the app's one HeapTrimmer, which large answers use too)."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float, heap: HeapTrimmer | None = None) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s
        self.heap = heap or HeapTrimmer()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chunks, seen, more = [], 0, True
        try:  # a client that sends its body slowly, or stops half-way, holds a connection for no longer
            async with asyncio.timeout(self.timeout_s):
                while more:
                    message = await receive()
                    if message["type"] != "http.request":  # the client went away: the route sees it as it would
                        return await self.app(scope, _replay([], message, receive), send)
                    chunks.append(message.get("body", b""))
                    seen += len(chunks[-1])
                    if seen > self.max_bytes:
                        return await _reject(scope, send, 413, "payload_too_large",
                                             f"request body over {self.max_bytes} bytes")
                    more = message.get("more_body", False)
        except TimeoutError:
            return await _reject(scope, send, 408, "request_timeout",
                                 f"request body not received within {self.timeout_s:g}s")
        try:
            await self.app(scope, _replay(chunks, None, receive), send)
        finally:
            if seen >= LARGE_BODY_BYTES:  # its memory is free now: give it back to the OS
                self.heap.after_large_request()


async def _reject(scope: Scope, send: Send, status: int, kind: str, message: str) -> None:
    response = error_response(scope["path"], status, kind, message)
    await response({"type": "http"}, None, send)  # type: ignore[arg-type]


def _replay(chunks: list[bytes], last: Message | None, receive: Receive) -> Receive:
    """A receive that gives the body read ahead as one message (or the message that ended the read), then the
    client's own receive (its disconnect)."""
    pending: list[Message] = [last] if last is not None else [
        {"type": "http.request", "body": b"".join(chunks), "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()
    return replayed


class RequestObserver:
    """Pure ASGI middleware (BaseHTTPMiddleware would hide client disconnects from the handlers), around every
    request: its RequestRecord (server.observability) for the service to fill in; the response headers x-request-id
    and the timings; fusedserve_requests_total{model,route,status} and fusedserve_request_duration_seconds{model,route}
    (model: the one the request was routed to, "" for none); with tracing on, the request's server span; and, after
    an answer of LARGE_ANSWER_BYTES or more (/tokenize's and /embed_all's grow with every token of a small body), the
    heap given back (server.heap).

    A request whose client went away before its answer (ClientGone or starlette's ClientDisconnect raised where it
    was noticed, or an answer made after the connection closed) is counted under status 499 and logged in one INFO
    line, and nothing is sent for it: an escaping exception would be a 500 and a traceback per disconnect."""

    def __init__(self, app: ASGIApp, service: Service, heap: HeapTrimmer | None = None) -> None:
        self.app, self.metrics, self.tracing = app, service.metrics, service.tracing
        self.heap = heap or HeapTrimmer()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.monotonic()
        given = next((v for k, v in scope.get("headers") or () if k == b"x-request-id"), None)
        record = RequestRecord(request_id(given.decode("latin-1") if given is not None else None), started)
        if self.tracing is not None:
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers") or ()}
            record.tracing = self.tracing
            record.span = self.tracing.start_request(scope["method"], scope["path"], headers, started)
        token = CURRENT.set(record)
        status, answered, gone = 500, 0, False
        # uvicorn's request cycle (receive is its bound method): its `disconnected` flag is how an answer made after
        # the client left is told apart (uvicorn drops it unsent); elsewhere only a raised disconnect counts
        cycle = getattr(receive, "__self__", None)

        async def observing_send(message: Message) -> None:
            nonlocal status, answered, gone
            if message["type"] == "http.response.body":  # made, sent or not: its memory is what counts
                answered += len(message.get("body", b""))
            if gone:
                return
            if message["type"] == "http.response.start":
                if getattr(cycle, "disconnected", False):
                    gone = True
                    return
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), *record.headers(time.monotonic())]
            await send(message)

        try:
            await self.app(scope, receive, observing_send)
        except (ClientGone, ClientDisconnect):
            gone = True
        finally:
            CURRENT.reset(token)
            elapsed = time.monotonic() - started
            if gone:
                status = CLIENT_GONE_STATUS
            route = getattr(scope.get("route"), "path", "unmatched")
            if route != "/metrics":
                self.metrics.requests.labels(record.model, route, str(status)).inc()
                self.metrics.request_duration.labels(record.model, route).observe(elapsed)
            if record.span is not None:
                self.tracing.end_request(record.span, route, status, record.id, record.model)
            if answered >= LARGE_ANSWER_BYTES:  # its memory is free now: give it back to the OS
                self.heap.after_large_request()
            if gone:
                log.info("client disconnected: %s %s after %.2fs, request id %s", scope["method"], scope["path"],
                         elapsed, record.id)


class HotRoutes:
    """Pure ASGI middleware, the innermost: a POST to one of the LeanRoutes (the routes that parse their own bodies,
    server.responses: POST /infer, /v1/embeddings and the TEI router's POSTs) goes straight to its handler, and its
    ServiceError or validation error to the app's handler for it. The router and the layers between it and here
    (exception middleware, FastAPI's exit stacks, the route's request/response wrapper) are a large share of the event
    loop's time per request (docs/decisions/0030-hot-routes-past-the-router.md), and the event loop's time is what
    bounds one process's requests/s. What the middleware above does (ids, metrics, limits, keys, the body read) is
    unchanged; every other request, and an error without a handler of its own (a 500), takes the usual way."""

    def __init__(self, app: ASGIApp, routes: list, exception_handlers: dict) -> None:
        """routes: the routers' own routes (their paths carry the routers' prefixes); exception_handlers: the app's,
        read when the middleware stack is built, at the first request."""
        self.app = app
        self.routes = {route.path: route for route in routes
                       if isinstance(route, LeanRoute) and route.methods == {"POST"} and not route.param_convertors}
        self.handlers = {path: route.get_route_handler() for path, route in self.routes.items()}
        # ExceptionMiddleware's share of the handlers; Exception's (500) stays with ServerErrorMiddleware, outermost
        self.errors = {cls: handler for cls, handler in exception_handlers.items()
                       if isinstance(cls, type) and cls is not Exception}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = None
        if scope["type"] == "http" and scope["method"] == "POST":
            path = get_route_path(scope)
            handler = self.handlers.get(path)
        if handler is None:
            return await self.app(scope, receive, send)
        route = self.routes[path]
        scope["route"], scope["endpoint"], scope["path_params"] = route, route.endpoint, {}
        request = Request(scope, receive, send)
        try:
            response = await handler(request)
        except Exception as exc:
            error = next((self.errors[cls] for cls in type(exc).__mro__ if cls in self.errors), None)
            if error is None:
                raise
            response = await error(request, exc)
        await response(scope, receive, send)


# open without an API key: the docs (a browser cannot send a bearer token for a page load), and /admin/*, which
# checks its own token
OPEN_PATHS = ("/docs", "/redoc", "/openapi.json", "/admin/")
# the probes and the scrape: open unless auth_probes
PROBE_PATHS = ("/healthz", "/readyz", "/health", "/metrics", "/v2/health/live", "/v2/health/ready")


class ApiKeys:
    """Pure ASGI middleware: with api_keys set, a request needs `Authorization: Bearer <key>` (401 with
    WWW-Authenticate otherwise, in the route's error shape), checked before its body is read. Every configured
    key is compared, in constant time, so neither the timing nor the order says which one nearly matched."""

    def __init__(self, app: ASGIApp, keys: list[str], probes: bool) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.open = OPEN_PATHS if probes else OPEN_PATHS + PROBE_PATHS

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or path.startswith(self.open):
            return await self.app(scope, receive, send)
        given = b""
        for key, value in scope.get("headers") or ():
            if key == b"authorization":
                scheme, _, given = value.partition(b" ")
                given = given.strip() if scheme.lower() == b"bearer" else b""
        if key_matches(self.keys, given):
            return await self.app(scope, receive, send)
        message = "missing API key (Authorization: Bearer <key>)" if not given else "invalid API key"
        response = error_response(path, 401, "unauthorized", message, code="invalid_api_key",
                                  headers={"WWW-Authenticate": 'Bearer realm="fusedserve"'})
        await response(scope, receive, send)


# FastAPI's own OpenTelemetry (0.16x) stays off: the service's spans and metrics (server.tracing, server.metrics)
# are the ones, and FastAPI's would add a second server span per request wherever a global provider is configured;
# off, it also skips the look at the global providers it makes on every request
# (docs/decisions/0030-hot-routes-past-the-router.md)
NO_TELEMETRY = {"telemetry": {"tracing": False, "metrics": False, "logs": False}} \
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {}
DOCS_ASSETS = "/docs/assets"
ROUTERS = (infer, openai, tei, rerank, kserve, health, admin)


def _mount_docs(app: FastAPI) -> None:
    """Swagger UI at /docs and ReDoc at /redoc from assets this app serves itself (the fastapi-offline package
    ships them), so the docs work on a machine without network access."""
    app.mount(DOCS_ASSETS, StaticFiles(directory=str(resources.files("fastapi_offline") / "static")),
              name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(openapi_url=root + app.openapi_url, title=f"{app.title} - Swagger UI",
                                   oauth2_redirect_url=root + "/docs/oauth2-redirect",
                                   swagger_js_url=f"{root}{DOCS_ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{root}{DOCS_ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{root}{DOCS_ASSETS}/favicon.png")

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(openapi_url=root + app.openapi_url, title=f"{app.title} - ReDoc",
                              redoc_js_url=f"{root}{DOCS_ASSETS}/redoc.standalone.js",
                              redoc_favicon_url=f"{root}{DOCS_ASSETS}/favicon.png", with_google_fonts=False)


def _declare_bearer_auth(app: FastAPI) -> None:
    """With API keys on, the schema says so (a bearer scheme on every operation), and Swagger UI's Authorize
    button takes a key for its "Try it out" calls."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            schema.setdefault("components", {}).setdefault("securitySchemes", {})["apiKey"] = {
                "type": "http", "scheme": "bearer", "description": "one of FUSEDSERVE_API_KEYS"}
            schema["security"] = [{"apiKey": []}]
        return app.openapi_schema

    app.openapi = openapi


def _first_param(errors: list[dict]) -> str | None:
    loc = [p for p in (errors[0].get("loc") or ()) if p != "body"] if errors else []
    return str(loc[0]) if loc else None


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    fix_malloc_thresholds()  # before the model and the tokenizer allocate: freed heap goes back (server.heap)
    service = FrontendService(settings, engines) if (engines := frontend.engine_addresses()) else Service(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # the port opens now: /healthz answers, /readyz says what is loading, everything else 503 until ready
        service.start()
        if workers.rejoining():  # a worker started again takes connections once ready: uvicorn listens after this
            while not service.ready and service.load_error is None:
                await asyncio.sleep(0.1)
            switch = workers.read_switch()
            if service.ready and switch is not None:  # the others' kernel path, before its first request
                await service.shared_switch.apply(switch)
        follower = asyncio.create_task(service.shared_switch.follow()) if service.follows_switch else None
        rpc = None
        if settings.grpc_port:  # in this event loop: its calls reach the service as the routes' do
            from fusedserve.server.kserve_grpc import KServeGrpc

            rpc = KServeGrpc(service, getattr(app.state, "host", "127.0.0.1"), settings.grpc_port)
            await rpc.start()
        yield
        if follower is not None:
            follower.cancel()
        log.warning("shutting down: draining accepted requests")
        drain = [asyncio.to_thread(service.shutdown)]
        if rpc is not None:  # new calls refused at once, those in flight answered (the queue drains for them too)
            drain.append(rpc.stop(settings.request_timeout_s + 1))
        await asyncio.gather(*drain)

    app = FastAPI(title="fusedserve", version=VERSION, lifespan=lifespan, docs_url=None, redoc_url=None, **NO_TELEMETRY,
                  description="Transformer-encoder embeddings on fused GPU kernels. Native (`/infer`), OpenAI "
                  "(`/v1/*`), text-embeddings-inference (`/embed`, ...) and KServe v2 (`/v2/*`) APIs.")
    app.state.service = service
    for module in ROUTERS:
        app.include_router(module.router)
    _mount_docs(app)
    if settings.api_keys:
        _declare_bearer_auth(app)

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError):
        return service_error_response(request.scope["path"], exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        path, errors = request.scope["path"], exc.errors()
        if errors and errors[0].get("type") == "json_invalid":  # not JSON at all (orjson's reason): 400, not 422
            reason = (errors[0].get("ctx") or {}).get("error") or "JSON decode error"
            return error_response(path, 400, "invalid_request", f"malformed JSON body: {reason}")
        problems = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in errors[:5])
        return error_response(path, 422, "validation_error", problems or "invalid request", param=_first_param(errors))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if isinstance(exc.__cause__, ClientDisconnect):  # FastAPI's 400 for a body whose client went away
            raise ClientGone("client disconnected while sending the body") from None
        kind = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(request.scope["path"], exc.status_code, kind, str(exc.detail),
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(request.scope["path"], 500, "internal_error", "internal error")

    # outermost last: CORS (answers preflights, decorates every answer) -> the observer (ids, timings, metrics,
    # spans; it sees the 401s, 413s and 431s too) -> the header limits (one Authorization header, read alike by the
    # key check and the admin check) -> API keys (before the body is read) -> the body, read whole -> the hot
    # routes' shortcut -> the routes
    app.add_middleware(HotRoutes, routes=[route for module in ROUTERS for route in module.router.routes],
                       exception_handlers=app.exception_handlers)
    heap = HeapTrimmer()  # one for large bodies and large answers: a burst of either is trimmed once
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, timeout_s=settings.request_timeout_s, heap=heap)
    if settings.api_keys:
        app.add_middleware(ApiKeys, keys=settings.api_keys, probes=settings.auth_probes)
    app.add_middleware(HeaderLimits, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestObserver, service=service, heap=heap)
    if settings.cors_allow_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_allow_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=list(TIMING_HEADERS), max_age=600)
    return app
