"""The one error type: everything a client sees as an error body is built here."""

from __future__ import annotations

from typing import Any


class LSEError(Exception):
    """An error with the HTTP status and the OpenAI-shaped body a client receives.

    Extra keyword fields (``levels``, ``lse_context``...) are placed in the body beside
    message/type/code/param, as the spec shows them.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.code = code
        self.param = param
        self.extra = extra

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.type, "code": self.code, "param": self.param}
        error.update(self.extra)
        return {"error": error}


def invalid_request(message: str, code: str, param: str | None = None, **extra: Any) -> LSEError:
    """A 400 invalid_request_error."""
    return LSEError(message, status=400, code=code, param=param, **extra)


def server_error(message: str, code: str | None = None, status: int = 500) -> LSEError:
    """A 5xx server_error (CPU fallback refused, engine failure, overload)."""
    return LSEError(message, status=status, type="server_error", code=code)


class StartupError(Exception):
    """lse_open could not start the engine; the message is the one-line reason."""
