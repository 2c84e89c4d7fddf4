"""Errors the router answers with, in the OpenAI error shape.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

Raised anywhere in the router as typed exceptions and turned into JSON once,
in the HTTP layer. Knows nothing of aiohttp.
"""

from __future__ import annotations


class APIError(Exception):
    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(APIError):
    """Malformed JSON or a request that is well-typed but not servable (400)."""


class InvalidField(APIError):
    """A missing or wrongly typed field (422)."""

    status = 422


class ModelNotFound(APIError):
    status = 404
    type = "not_found_error"


class RouteNotFound(APIError):
    status = 404
    type = "not_found_error"


class Unauthorized(APIError):
    status = 401
    type = "authentication_error"


class ServiceUnavailable(APIError):
    """No live worker could take the request (503)."""

    status = 503
    type = "service_unavailable"


class InternalError(APIError):
    status = 500
    type = "server_error"
