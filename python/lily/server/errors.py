"""Client-facing errors: one exception, rendered as OpenAI or Anthropic shape them."""

from __future__ import annotations

from typing import Any

__all__ = ["ApiError"]

# Anthropic names its error types by status.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class ApiError(Exception):
    """A request the server refuses (4xx) or could not serve (5xx), with the fields both APIs report:
    ``type`` (OpenAI's ``invalid_request_error``, ...), ``code`` (``context_length_exceeded``, ...) and
    the ``param`` it is about; ``headers`` go with the response (a 429's ``Retry-After``)."""

    def __init__(self, message: str, status: int = 400, *, type: str | None = None, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param
        self.headers = dict(headers or {})
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def openai(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}

    def anthropic(self) -> dict[str, Any]:
        kind = _ANTHROPIC_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": str(self)}}

    def body(self, dialect: str) -> dict[str, Any]:
        """The error object of ``dialect`` ("openai" or "anthropic")."""
        return self.anthropic() if dialect == "anthropic" else self.openai()
