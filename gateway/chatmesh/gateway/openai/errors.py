"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, with the HTTP status the `openai`
SDK maps to its exception classes (400 BadRequestError, 401 AuthenticationError, 403 PermissionDeniedError,
404 NotFoundError, 409 ConflictError, 422 UnprocessableEntityError, 429 RateLimitError, >=500
InternalServerError).

The edge's own errors (`chatmesh.gateway.errors.ApiError`, from its checks and from gRPC status codes through
the edge's one mapping) are re-shaped here, never re-mapped, with two differences the SDK makes necessary:
- 413 (body or message too large) is answered 400 naming the parameter: the SDK has no class for 413;
- 409 `failed_precondition` (valid request, but the conversation's state forbids it) is answered 422: the SDK
  retries every 409 by itself, which cannot help when the state is the reason.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from chatmesh.gateway.errors import ApiError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 409: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error"}


class OpenAIError(ApiError):
    """An ApiError that also names the request parameter at fault (OpenAI's `param`)."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(status, code, message, retry_after_s)
        self.param = param


def invalid(param: str | None, message: str, code: str = "invalid_value") -> OpenAIError:
    """A 400 naming the parameter (`messages[2].content`, `temperature`)."""
    return OpenAIError(400, code, f"{param}: {message}" if param else message, param)


def unsupported(param: str, why: str = "") -> OpenAIError:
    return invalid(param, f"not supported by chatmesh{': ' + why if why else ''}", "unsupported_parameter")


def not_found(what: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(404, "not_found", f"{what} not found", param)


def shaped(err: ApiError) -> tuple[int, dict[str, object]]:
    """The status and OpenAI-shaped body of any edge error."""
    status, code = err.status, err.code
    param = err.param if isinstance(err, OpenAIError) else None
    if status == 413:
        status, code = 400, "payload_too_large"
    elif status == 409 and code == "failed_precondition":
        status = 422
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return status, {"error": {"message": err.message, "type": kind, "param": param, "code": code}}


def can_succeed_on_retry(status: int) -> bool:
    """Whether the same request, sent again, may get another answer: after a timeout (408), a limit (429) or a
    dependency's failure (5xx but 501). Every other error is the request's own, or the stored state's (a 409:
    an Idempotency-Key reused for another request, a turn id used for other content), so the SDK is told not to
    retry it (`x-should-retry: false`); by itself it retries 408, 409, 429 and 5xx."""
    return status in (408, 429) or (status >= 500 and status != 501)


def response_for(err: ApiError) -> JSONResponse:
    status, body = shaped(err)
    headers = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, int(err.retry_after_s + 0.999)))
    if not can_succeed_on_retry(status):
        headers["x-should-retry"] = "false"
    return JSONResponse(body, status, headers=headers)
