"""OpenAI-style errors: one exception type, and the FastAPI handlers that turn it (and
Starlette's 404 / 405, validation errors, anything unexpected) into

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

with the right status. Overload answers carry `Retry-After` (whole seconds). A 500
says what failed in one line, never a stack trace (that goes to the log).
"""

from __future__ import annotations

import logging
import math
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 501: "server_error", 503: "server_error"}


class ApiError(Exception):
    """An HTTP error answered as an OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        if retry_after is not None:
            self.headers["Retry-After"] = str(max(1, math.ceil(retry_after)))

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    # ---- the common cases ------------------------------------------------------
    @classmethod
    def invalid(cls, message: str, param: str | None = None, code: str | None = None) -> "ApiError":
        return cls(400, message, param, code)

    @classmethod
    def context_length(cls, message: str, param: str) -> "ApiError":
        return cls(400, message, param, "context_length_exceeded")

    @classmethod
    def model_not_found(cls, name: str) -> "ApiError":
        return cls(404, f"The model `{name}` does not exist.", "model", "model_not_found")

    @classmethod
    def overloaded(cls, status: int, message: str, retry_after: float) -> "ApiError":
        code = "queue_full" if status == 429 else "overloaded"
        return cls(status, message, None, code, retry_after=retry_after)

    @classmethod
    def from_backend(cls, err: Exception) -> "ApiError":
        """A BackendError (status, retry_after) as an API error."""
        status = getattr(err, "status", 500)
        retry = getattr(err, "retry_after", None)
        if status in (429, 503):
            return cls.overloaded(status, str(err), retry if retry is not None else 1.0)
        code = "internal_error" if status >= 500 else None
        return cls(status, str(err), None, code, retry_after=retry)

    @classmethod
    def internal(cls, exc: BaseException) -> "ApiError":
        """An unexpected failure: the exception's type only (details stay in the log)."""
        return cls(500, f"internal server error: {type(exc).__name__}", None, "internal_error")

    @classmethod
    def from_validation(cls, errors: list[dict]) -> "ApiError":
        """The first of pydantic's `errors()`; `param` is the top-level field."""
        first = errors[0]
        if first["type"] == "json_invalid":
            return cls.invalid(f"invalid JSON body: {first['msg']}", None, "invalid_json")
        loc = [p for p in first["loc"] if p != "body"]  # FastAPI prefixes body fields
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
        msg = first["msg"].removeprefix("Value error, ")
        param = loc[0] if loc and isinstance(loc[0], str) else None
        return cls.invalid(f"{where or 'request body'}: {msg}", param)


def install_error_handlers(app: FastAPI, on_error: Callable[[int], None] | None = None) -> None:
    """Register the handlers; `on_error(status)` is called for every error answered."""

    def answer(err: ApiError) -> JSONResponse:
        if on_error is not None:
            on_error(err.status)
        return err.response()

    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return answer(exc)

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            err = ApiError(404, f"no route {request.method} {request.url.path}", None, "not_found")
        elif exc.status_code == 405:
            err = ApiError(405, f"method {request.method} is not allowed on {request.url.path}",
                           None, "method_not_allowed")
        else:
            err = ApiError(exc.status_code, str(exc.detail))
        err.headers.update(exc.headers or {})
        return answer(err)

    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(ApiError.from_validation(list(exc.errors())))

    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return answer(ApiError.internal(exc))

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, internal_error)
