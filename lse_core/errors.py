"""The one error type: everything a client sees as an error body is built here."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema


class ErrorDetail(BaseModel):
    """The error object; the optional fields appear only on the errors that carry them."""

    model_config = ConfigDict(extra="forbid")   # an extra field not declared here would be missing from /openapi.json

    message: str
    type: str
    code: str | None
    param: str | None
    levels: list[str] = Field(None, description="thinking errors: the model's level ids")
    # lse_core.limits declares LSEContext and imports this module, so the schema names it by reference (under
    # allOf: pydantic would look a bare $ref up among its own definitions)
    lse_context: Annotated[dict[str, int], WithJsonSchema({"allOf": [{"$ref": "#/components/schemas/LSEContext"}]})] \
        = Field(None, description="context_full: the prompt against the context")
    models: list[str] = Field(None, description="model_not_found: the served model ids")


class Error(BaseModel):
    """The OpenAI-shaped error body."""

    error: ErrorDetail


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
        detail = ErrorDetail(message=self.message, type=self.type, code=self.code, param=self.param, **self.extra)
        return Error(error=detail).model_dump(exclude_unset=True)


def invalid_request(message: str, code: str, param: str | None = None, **extra: Any) -> LSEError:
    """A 400 invalid_request_error."""
    return LSEError(message, status=400, code=code, param=param, **extra)


def model_not_found(name: str, ids: list[str]) -> LSEError:
    """404 for a request naming a model that is not among ``ids``, the served ones (listed in the body too)."""
    return LSEError(f"the model {name!r:.200} is not served here; this server serves {', '.join(map(repr, ids))}",
                    status=404, code="model_not_found", param="model", models=ids)


def server_error(message: str, code: str | None = None, status: int = 500) -> LSEError:
    """A 5xx server_error (CPU fallback refused, engine failure, overload)."""
    return LSEError(message, status=status, type="server_error", code=code)


class StartupError(Exception):
    """lse_open could not start the engine; the message is the one-line reason."""
