"""One error hierarchy for the service, mapped to HTTP status codes in one place. Bodies are always
{"error": {"type": ..., "message": ...}} and never carry stack traces or file paths."""

from __future__ import annotations


class ServiceError(Exception):
    status = 500
    type = "internal_error"
    headers: dict[str, str] = {}

    def __init__(self, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        if headers:
            self.headers = headers


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
