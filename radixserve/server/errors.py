"""HTTP errors with OpenAI-style bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from radixserve.log_bounds import bounded_logger, clip

import re
import uuid

import msgspec
from starlette.requests import Request
from starlette.responses import Response


log = bounded_logger(__name__)
MAX_ERROR_CHARS = 1000  # of an error's message


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


class ApiError(Exception):
    """An error the client should see: an HTTP status and an OpenAI-style body naming the bad parameter."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        # An error may quote what the client sent (a field's name, a path, a value): bounded, so no answer echoes
        # megabytes back.
        message = clip(message, MAX_ERROR_CHARS)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = None if param is None else clip(param)
        self.code = code
        self.type = type
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 invalid_request_error naming `param`."""
    return ApiError(400, message, param=param, code=code)


def error_response(err: ApiError, path: str = "") -> Response:
    """The JSON response for an ApiError, in the envelope of the API that `path` belongs to (Anthropic's for
    /v1/messages, OpenAI's everywhere else)."""
    if path.startswith(ANTHROPIC_PREFIX):
        body: msgspec.Struct = AnthropicErrorBody(AnthropicError(anthropic_type(err.status), _with_param(err)))
    else:
        body = ErrorBody(ErrorDetail(err.message, err.type, err.param, err.code))
    return Response(
        msgspec.json.encode(body), status_code=err.status, headers=err.headers, media_type="application/json"
    )


# ---------------------------------------------------------------- Anthropic's envelope

ANTHROPIC_PREFIX = "/v1/messages"
# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors); another 5xx is an api_error.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


class AnthropicError(msgspec.Struct):
    type: str
    message: str


class AnthropicErrorBody(msgspec.Struct):
    error: AnthropicError
    type: str = "error"


def anthropic_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def _with_param(err: ApiError) -> str:
    """Anthropic's envelope has no `param`: the field goes into the message (as Anthropic writes `messages.0: ...`)."""
    return f"{err.param}: {err.message}" if err.param and not err.message.startswith(err.param) else err.message


async def api_error_handler(request: Request, exc: Exception) -> Response:
    """Starlette exception handler for ApiError."""
    assert isinstance(exc, ApiError)
    return error_response(exc, request.url.path)


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    """Starlette's own HTTPExceptions (404, 405) with an OpenAI-style body instead of plain text."""
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", None) or "error"
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    headers = getattr(exc, "headers", None)  # a 405's Allow: the methods the route takes
    return error_response(
        ApiError(status, f"{detail}: {request.method} {request.url.path}", type=kind, headers=headers), request.url.path
    )


async def internal_error_handler(request: Request, exc: Exception) -> Response:
    """Any unexpected exception: a 500 with a generic body and an id to find the traceback in the log by (the
    exception's text stays in the log: it may hold another request's data)."""
    error_id = uuid.uuid4().hex[:12]
    log.error("internal error %s on %s %s", error_id, request.method, request.url.path, exc_info=exc)
    return error_response(ApiError(500, f"internal error (id {error_id})", type="internal_error"), request.url.path)


_AT_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>[^`]+)`")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`")


def from_decode_error(exc: msgspec.MsgspecError) -> ApiError:
    """Turn a msgspec decode/validation error into a 400 naming the offending parameter path (e.g. messages[0].role)."""
    text = str(exc)
    path = ""
    m = _AT_PATH.search(text)
    if m:
        path = m.group("path").lstrip(".")
        text = text[: m.start()]
    unknown = _UNKNOWN.match(text)
    if unknown:
        field = unknown.group("field")
        param = f"{path}.{field}" if path else field
        return bad_request(f"unsupported parameter: {param}", param=param, code="unsupported_parameter")
    missing = _MISSING.match(text)
    if missing:
        field = missing.group("field")
        param = f"{path}.{field}" if path else field
        return bad_request(f"missing required parameter: {param}", param=param, code="missing_required_parameter")
    if isinstance(exc, msgspec.ValidationError):
        return bad_request(f"{path or 'body'}: {text}", param=path or None)
    return bad_request(f"malformed JSON body: {text}", code="invalid_json")
