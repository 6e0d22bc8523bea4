"""HTTP errors of the edge: one JSON shape, `{"error": {"code": ..., "message": ...}}`, and the one mapping
from gRPC status codes (what ChatService answers) to HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from starlette.responses import JSONResponse


@dataclass(frozen=True)
class HttpStatus:
    status: int
    code: str


# The one mapping from gRPC status codes to HTTP. FAILED_PRECONDITION is 409: the request is valid but the
# conversation's state forbids it now (regenerate with no reply to regenerate). CANCELLED and DEADLINE_EXCEEDED
# read as a dependency that did not answer, hence 503 (retryable), never a 5xx that blames the caller.
_BY_GRPC: dict[grpc.StatusCode, HttpStatus] = {
    grpc.StatusCode.INVALID_ARGUMENT: HttpStatus(400, "invalid_argument"),
    grpc.StatusCode.OUT_OF_RANGE: HttpStatus(400, "invalid_argument"),
    grpc.StatusCode.UNAUTHENTICATED: HttpStatus(401, "unauthenticated"),
    grpc.StatusCode.PERMISSION_DENIED: HttpStatus(403, "permission_denied"),
    grpc.StatusCode.NOT_FOUND: HttpStatus(404, "not_found"),
    grpc.StatusCode.ALREADY_EXISTS: HttpStatus(409, "conflict"),
    grpc.StatusCode.ABORTED: HttpStatus(409, "conflict"),
    grpc.StatusCode.FAILED_PRECONDITION: HttpStatus(409, "failed_precondition"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: HttpStatus(429, "rate_limited"),
    grpc.StatusCode.UNAVAILABLE: HttpStatus(503, "unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: HttpStatus(503, "unavailable"),
    grpc.StatusCode.CANCELLED: HttpStatus(503, "unavailable"),
    grpc.StatusCode.UNIMPLEMENTED: HttpStatus(501, "not_implemented"),
}
_INTERNAL = HttpStatus(500, "internal")


def http_for_grpc(code: grpc.StatusCode) -> HttpStatus:
    return _BY_GRPC.get(code, _INTERNAL)


class ApiError(Exception):
    """An error answered to the HTTP caller as is. `retry_after_s` becomes the Retry-After header."""

    def __init__(self, status: int, code: str, message: str, retry_after_s: float | None = None, limit: str = ""):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.limit = limit  # a 429's budget, as a metric label ("turns_per_minute"); empty otherwise

    @classmethod
    def from_rpc(cls, err: grpc.aio.AioRpcError) -> ApiError:
        mapped = http_for_grpc(err.code())
        if mapped.status >= 500:  # transport details (addresses, peers) are not the caller's business
            return cls(mapped.status, mapped.code, "the chat service is unavailable; retry later"
                       if mapped.status == 503 else "internal error")
        return cls(mapped.status, mapped.code, err.details() or err.code().name.lower())

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, int(self.retry_after_s + 0.999)))
        return JSONResponse({"error": {"code": self.code, "message": self.message}}, self.status, headers=headers)


def bad_request(message: str) -> ApiError:
    return ApiError(400, "invalid_argument", message)
