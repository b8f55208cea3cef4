"""App factory: routes, one error mapping, request metrics and the body-size limit, and the lifespan
(load the model, warm up, then ready; on shutdown refuse new work and drain the queue)."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.config import Settings
from server.errors import ServiceError, error_body
from server.routes import admin, health, infer, kserve, openai
from server.service import Service

log = logging.getLogger("fusedserve")


class BodyLimit:
    """Pure ASGI middleware: 413 once a request body passes max_body_bytes (declared or streamed)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or {}).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._reject(send)
        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge()
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._reject(send)

    async def _reject(self, send: Send) -> None:
        response = JSONResponse(error_body("payload_too_large", f"request body over {self.max_bytes} bytes"),
                                status_code=413)
        await response({"type": "http"}, None, send)  # type: ignore[arg-type]


class _TooLarge(Exception):
    pass


class RequestMetrics:
    """Pure ASGI middleware (BaseHTTPMiddleware would hide client disconnects from the handlers):
    fusedserve_requests_total{route,status} and fusedserve_request_duration_seconds{route}."""

    def __init__(self, app: ASGIApp, service: Service) -> None:
        self.app, self.metrics = app, service.metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        status = 500

        async def tracking_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            if route != "/metrics":
                self.metrics.requests.labels(route, str(status)).inc()
                self.metrics.request_duration.labels(route).observe(time.perf_counter() - started)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    service = Service(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await asyncio.to_thread(service.load)
        if settings.warmup:
            await asyncio.to_thread(service.warm_up)
        service.mark_ready()
        log.warning("ready\n%s", service.startup_report())
        yield
        log.warning("shutting down: draining accepted requests")
        await asyncio.to_thread(service.shutdown)

    app = FastAPI(title="fusedserve", version="0.1.0", lifespan=lifespan,
                  description="Transformer-encoder embeddings on fused GPU kernels")
    app.state.service = service
    for module in (infer, openai, kserve, health, admin):
        app.include_router(module.router)

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError):
        return JSONResponse(error_body(exc.type, exc.message), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        if errors and errors[0].get("type") == "json_invalid":  # not JSON at all (orjson's reason): 400, not 422
            reason = (errors[0].get("ctx") or {}).get("error") or "JSON decode error"
            return JSONResponse(error_body("invalid_request", f"malformed JSON body: {reason}"), status_code=400)
        problems = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in errors[:5])
        return JSONResponse(error_body("validation_error", problems or "invalid request"), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse(error_body(kind, str(exc.detail)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body("internal_error", "internal error"), status_code=500)

    app.add_middleware(RequestMetrics, service=service)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    return app
