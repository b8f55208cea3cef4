"""One error hierarchy for the service, mapped to HTTP status codes in one place, and the one place that writes
error bodies. Bodies are always JSON and never carry stack traces or file paths. Their shape follows the protocol
of the route, so each family's own clients can read them:

- our routes: `{"error": {"type", "message"}}`
- OpenAI (`/v1/*`): `{"error": {"message", "type", "param", "code"}}`, `type` one of OpenAI's
  (`invalid_request_error`, `authentication_error`, ...), `code` our type (or `model_not_found`)
- KServe v2 / Open Inference Protocol (`/v2`, `/v2/*`): `{"error": "<message>"}`
- text-embeddings-inference (`/`, `/embed`, `/embed_all`, `/embed_sparse`, `/similarity`, `/tokenize`, `/decode`,
  `/health`, `/rerank`, `/predict`):
  `{"error": "<message>", "error_type": "validation" | "overloaded" | "unhealthy" | "backend" | "unauthorized"}`
"""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse


def ascii_int(value: str | bytes) -> bool:
    """A numeric header or field as the protocols write one: 1-18 ASCII digits (str.isdigit() also takes '²', which
    int() then refuses)."""
    return re.fullmatch(rb"[0-9]{1,18}", value if isinstance(value, bytes) else value.encode()) is not None


def quoted(value: str, limit: int = 100) -> str:
    """A client's value as an error message repeats it: quoted, and cut at `limit` characters (a message never
    echoes a whole oversized field back)."""
    return repr(value) if len(value) <= limit else f"{value[:limit]!r}... ({len(value)} characters)"


def clipped(text: str, limit: int = 100) -> str:
    """Text built from a client's value (a shape, a number) as an error message repeats it: unquoted, and cut at
    `limit` characters, saying how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class ServiceError(Exception):
    status = 500
    type = "internal_error"
    headers: dict[str, str] = {}
    param: str | None = None  # the request field at fault, where one is (OpenAI's `param`)
    code: str | None = None  # a finer code than `type` (OpenAI's `code`), e.g. model_not_found

    def __init__(self, message: str, *, headers: dict[str, str] | None = None, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if headers:
            self.headers = headers
        if param is not None:
            self.param = param
        if code is not None:
            self.code = code


class BadRequest(ServiceError):
    status, type = 400, "invalid_request"


class Unauthorized(ServiceError):
    status, type = 401, "unauthorized"


class NotFound(ServiceError):
    status, type = 404, "not_found"


class PayloadTooLarge(ServiceError):
    status, type = 413, "payload_too_large"


class Unprocessable(ServiceError):
    status, type = 422, "validation_error"


class Overloaded(ServiceError):
    status, type = 429, "overloaded"


class Unavailable(ServiceError):
    status, type = 503, "unavailable"


class Timeout(ServiceError):
    status, type = 504, "timeout"


def error_body(type_: str, message: str) -> dict:
    return {"error": {"type": type_, "message": message}}


TEI_PATHS = frozenset({"/", "/embed", "/embed_all", "/embed_sparse", "/similarity", "/tokenize", "/decode",
                       "/health", "/rerank", "/predict"})


def protocol(path: str) -> str:
    """Which error shape a path's clients read: openai, kserve, tei, or ours."""
    if path.startswith("/v1/"):
        return "openai"
    if path == "/v2" or path.startswith("/v2/"):
        return "kserve"
    if path in TEI_PATHS:
        return "tei"
    return "fusedserve"


def _openai_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def _tei_type(status: int) -> str:
    return {401: "unauthorized", 429: "overloaded", 503: "unhealthy"}.get(status) or (
        "backend" if status >= 500 else "validation")


def render_error(path: str, status: int, type_: str, message: str, *, param: str | None = None,
                 code: str | None = None) -> dict:
    """The error body for a request to `path`, in the shape of that route's protocol."""
    kind = protocol(path)
    if kind == "openai":
        return {"error": {"message": message, "type": _openai_type(status), "param": param, "code": code or type_}}
    if kind == "kserve":
        return {"error": message}
    if kind == "tei":
        return {"error": message, "error_type": _tei_type(status)}
    return error_body(type_, message)


def error_response(path: str, status: int, type_: str, message: str, *, headers: dict[str, str] | None = None,
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(render_error(path, status, type_, message, param=param, code=code), status_code=status,
                        headers=headers)


def service_error_response(path: str, exc: ServiceError) -> JSONResponse:
    return error_response(path, exc.status, exc.type, exc.message, headers=exc.headers, param=exc.param,
                          code=exc.code)
