"""API errors and the one place that maps every failure to a JSON response.

Every error body has the same shape, which is also the OpenAI SDK's:
``{"error": {"type": "...", "message": "..."}}``.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

import msgspec
from litestar import MediaType, Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi.datastructures import ResponseSpec
from litestar.types import ExceptionHandlersMap

from chatsvc.store import SessionBusyError, StorageQuotaError, StoreUnavailableError
from chatsvc.store.errors import InvalidInputError, LimitExceededError, UnconfirmedWriteError
from chatsvc.store.errors import NotFoundError as StoreNotFoundError

log = logging.getLogger(__name__)


class ErrorDetail(msgspec.Struct, kw_only=True):
    type: str
    message: str


class ErrorBody(msgspec.Struct, kw_only=True):
    """The body of every error response."""

    error: ErrorDetail


class ApiError(Exception):
    """A failure with a status and a stable machine-readable type."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(
        self,
        message: str,
        *,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if error_type is not None:
            self.error_type = error_type
        # Sent with the answer (Retry-After on a 503 during start-up).
        self.headers = headers


class InvalidRequestError(ApiError):
    """Bad input: values out of range, empty or oversized text, bad sampling options."""


class InvalidHostError(ApiError):
    """The ``Host`` header names a host this server does not serve (see host_check.py)."""

    error_type = "invalid_host"


class ContextLengthError(ApiError):
    error_type = "context_length_exceeded"


class AuthenticationError(ApiError):
    status_code = 401
    error_type = "authentication_error"


class PermissionDeniedError(ApiError):
    status_code = 403
    error_type = "permission_error"


class NotFoundError(ApiError):
    status_code = 404
    error_type = "not_found_error"


class ConflictError(ApiError):
    status_code = 409
    error_type = "conflict_error"


class RateLimitError(ApiError):
    status_code = 429
    error_type = "rate_limit_error"


class ServiceUnavailableError(ApiError):
    status_code = 503
    error_type = "service_unavailable"


class InternalServerError(ApiError):
    """Our failure, not the client's: the message stays generic, the detail goes to the log."""

    status_code = 500
    error_type = "server_error"


# What a caller learns of a Redis outage. The exception's own text names the
# server (host, port, socket path) and the driver's error; that is for the log.
STORE_UNAVAILABLE_MESSAGE = "the session store is unavailable; try again later"
# A write the primary applied but no replica confirmed in time (Sentinel's WAIT):
# it may be stored, so "try again" alone would store a turn twice.
UNCONFIRMED_WRITE_MESSAGE = (
    "the session store applied this write but could not confirm it on a replica in "
    "time: it may be stored; read the session back before sending it again"
)


def error_body(error_type: str, message: str) -> dict[str, dict[str, str]]:
    return {"error": {"type": error_type, "message": message}}


def store_failure(exc: StoreUnavailableError, what: str) -> tuple[str, str]:
    """(error type, message) telling a streaming client what a store failure means for
    ``what`` (the turn, the response): not stored, or perhaps stored."""
    if isinstance(exc, UnconfirmedWriteError):
        return (
            "store_write_unconfirmed",
            f"{what} may have been stored: {UNCONFIRMED_WRITE_MESSAGE}",
        )
    return "store_unavailable", f"{what} was not stored: {STORE_UNAVAILABLE_MESSAGE}"


def log_store_unavailable(request: Request | None, exc: StoreUnavailableError) -> None:
    """Log the detail of an outage that a caller is told about only generically."""
    where = f" on {request.method} {request.url.path}" if request is not None else ""
    log.warning("session store unavailable%s: %s", where, exc)


def _json(
    status: int, error_type: str, message: str, headers: dict[str, str] | None = None
) -> Response:
    return Response(
        content=error_body(error_type, message),
        status_code=status,
        media_type=MediaType.JSON,
        headers=headers,
    )


def _api_error(_: Request, exc: ApiError) -> Response:
    return _json(exc.status_code, exc.error_type, exc.message, exc.headers)


def _session_busy(_: Request, exc: SessionBusyError) -> Response:
    return _json(409, "session_busy", "another message of this session is still being generated")


def _storage_quota(_: Request, exc: StorageQuotaError) -> Response:
    # The store's message names the limit and holds no id.
    return _json(429, "rate_limit_error", str(exc))


def _store_not_found(_: Request, exc: StoreNotFoundError) -> Response:
    # The store's message names the id; the answer stays the same for every
    # unknown or foreign id so that ids leak nothing.
    return _json(404, "not_found_error", "not found")


def _store_invalid_input(_: Request, exc: InvalidInputError) -> Response:
    # The store checks its arguments before it reads or writes, and its message
    # names the field for the client (a malformed id a handler did not turn into
    # 404 first lands here too, as bad input).
    return _json(400, "invalid_request_error", str(exc))


def _store_limit(_: Request, exc: LimitExceededError) -> Response:
    return _json(429, "rate_limit_error", f"{exc}; delete some first")


def _store_unavailable(request: Request, exc: StoreUnavailableError) -> Response:
    log_store_unavailable(request, exc)
    return _json(503, "store_unavailable", STORE_UNAVAILABLE_MESSAGE)


def _store_unconfirmed(request: Request, exc: UnconfirmedWriteError) -> Response:
    log_store_unavailable(request, exc)
    return _json(503, "store_write_unconfirmed", UNCONFIRMED_WRITE_MESSAGE)


def _validation(_: Request, exc: ValidationException) -> Response:
    # Litestar puts the msgspec reason ("Object contains unknown field `x`",
    # "malformed JSON") into `extra`; the detail alone only says "Validation failed".
    reasons = []
    for item in exc.extra if isinstance(exc.extra, list) else []:
        if isinstance(item, dict) and item.get("message"):
            where = item.get("key")
            reasons.append(f"{where}: {item['message']}" if where else str(item["message"]))
    message = "; ".join(reasons) or exc.detail or "invalid request"
    return _json(400, "invalid_request_error", message)


def _http(_: Request, exc: HTTPException) -> Response:
    kinds = {
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        405: "method_not_allowed",
        408: "request_timeout",
        415: "unsupported_media_type",
        413: "request_too_large",
        429: "rate_limit_error",
    }
    kind = kinds.get(exc.status_code, "invalid_request_error" if exc.status_code < 500 else "")
    return _json(exc.status_code, kind or "server_error", exc.detail, exc.headers)


def _undecodable(_: Request, exc: UnicodeDecodeError) -> Response:
    # Found by fuzzing: msgspec raises this (not a validation error) on invalid UTF-8.
    return _json(400, "invalid_request_error", "the body is not valid UTF-8")


def _too_deep(_: Request, exc: RecursionError) -> Response:
    # Found by fuzzing: deeply nested JSON exhausts msgspec's decoding depth.
    return _json(400, "invalid_request_error", "the request is nested too deeply")


def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _json(500, "server_error", "internal server error")


EXCEPTION_HANDLERS: ExceptionHandlersMap = {
    ApiError: _api_error,
    SessionBusyError: _session_busy,
    StorageQuotaError: _storage_quota,
    StoreUnavailableError: _store_unavailable,
    UnconfirmedWriteError: _store_unconfirmed,
    StoreNotFoundError: _store_not_found,
    InvalidInputError: _store_invalid_input,
    LimitExceededError: _store_limit,
    ValidationException: _validation,
    HTTPException: _http,
    UnicodeDecodeError: _undecodable,
    RecursionError: _too_deep,
    Exception: _unexpected,
}


def documented_errors(*statuses: int) -> dict[int, ResponseSpec]:
    """OpenAPI entries for a handler's error answers, all with the one error body."""
    return {
        status: ResponseSpec(
            ErrorBody, description=HTTPStatus(status).phrase, generate_examples=False
        )
        for status in statuses
    }
