"""OpenAI error bodies for the edge's HTTP API: ``{"error": {message, type, param, code}}``
for every failure, FastAPI's own 422s and 404/405s included."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from edge_gateway.engine_api import GenerationError


class InvalidRequest(Exception):
    """A request the API refuses before it reaches the engine (400 unless told)."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status_code: int = 400,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status_code, self.code = message, param, status_code, code


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(
    status_code: int,
    message: str,
    error_type: str,
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, error_type, param, code), status_code=status_code)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """pydantic's first error as (message, param): OpenAI names one offending field."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "could not parse the request body as JSON", None
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        # a field this server would otherwise ignore: refused, never silently dropped
        return f"{param}: this server does not support this field", param
    message = str(first.get("msg", "invalid value"))
    return (f"{param}: {message}" if param else message), param


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    message, param = _validation_message(exc)
    return error_response(400, message, "invalid_request_error", param)


async def _on_invalid_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, InvalidRequest)
    return error_response(
        exc.status_code, exc.message, "invalid_request_error", exc.param, exc.code
    )


async def _on_generation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GenerationError)
    response = error_response(exc.status_code, exc.message, exc.error_type)
    if exc.retry_after_s is not None:
        response.headers["Retry-After"] = str(exc.retry_after_s)
    return response


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return error_response(exc.status_code, str(exc.detail), error_type)


async def _on_unexpected_error(request: Request, exc: Exception) -> Response:
    return error_response(500, "internal server error", "server_error")


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI error bodies for every failure: FastAPI's 422 ``{"detail": ...}`` (malformed
    JSON included) becomes a 400 ``invalid_request_error``; 404/405 get the same shape."""
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(InvalidRequest, _on_invalid_request)
    app.add_exception_handler(GenerationError, _on_generation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected_error)
