"""What every API's body and adapter share: a body checked against its pydantic model (an LSEError naming
the field by its path, with the spec's code), and the core's streamed chunks read back as deltas and an
ending."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from lse_core.errors import LSEError, invalid_request

Model = TypeVar("Model", bound=BaseModel)

# LSE's own request fields (spec/API.md) that pass through every adapter unchanged; the core checks them.
LSE_FIELDS = ("top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed",
              "enable_thinking", "reasoning_effort", "thinking_level", "chat_template_kwargs", "thinking_budget")


# JSON has one number type, and JSON Schema counts 2.0 as an integer: so do the bodies (strict otherwise).
# The validator goes after any constraint, or pydantic's JSON Schema loses the constraint.
def integral(value: Any) -> Any:
    """An integral float as the integer it is (2.0 -> 2); any other value as it is."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


AS_INTEGER = BeforeValidator(integral)
Integer = Annotated[int, AS_INTEGER]
Positive = Annotated[int, Field(ge=1), AS_INTEGER]
# Bounds that depend on the served model: /openapi.json sets them on each schema marked so (lse_http.openapi)
TOKEN_ID_MARK = "x-lse-token-id"      # at most the vocabulary's last id
WIDTH_MARK = "x-lse-hidden-size"      # at most the model's hidden size
TokenId = Annotated[int, Field(ge=0, json_schema_extra={TOKEN_ID_MARK: True}), AS_INTEGER]
Text = Annotated[str, Field(min_length=1)]
Count = Annotated[int, Field(ge=0)]
# A reply part declared as a pydantic dataclass: its serialization schema lists every field as present.
REPLY_PART = ConfigDict(json_schema_serialization_defaults_required=True)
Item = TypeVar("Item")
NonEmpty = Annotated[Item, Field(min_length=1)]


class Body(BaseModel):
    """A request body: unknown fields are ignored (as OpenAI's and Anthropic's APIs do), no type coercion."""

    model_config = ConfigDict(extra="ignore", strict=True)


class Part(BaseModel):
    """A nested object of a body: the same rules, and its unknown fields (ids, statuses) ignored too."""

    model_config = ConfigDict(extra="ignore", strict=True)


def checked(model: type[Model], body: Any) -> Model:
    """``body`` as ``model``, or a 400 whose param is the path of the first bad field ("input[2].content")."""
    if not isinstance(body, dict):
        raise invalid_request("the request body must be a JSON object", "invalid_type")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise _field_error(e, body) from None


def _field_error(error: ValidationError, body: dict[str, Any]) -> LSEError:
    """The most specific of pydantic's errors as an LSEError: a union reports one per member, and the one
    that got furthest into the body (deepest, then at the latest item, then one whose type matched: a
    value out of range says more than "not a string") says what is wrong."""
    found = [(_path(e["loc"], body, e["type"] == "missing"), e) for e in error.errors(include_url=False)]
    path, worst = max(found, key=lambda pair: (pair[0].count(".") + pair[0].count("["),
                                               [int(i) for i in re.findall(r"\[(\d+)\]", pair[0])],
                                               not _is_type_error(pair[1])))
    kind, message = worst["type"], worst["msg"]
    if worst["input"] is None and path and not path.endswith("]") and kind != "missing":
        kind, message = "missing", "Field required"   # a field sent as null counts as not sent
    code = ("missing_field" if kind in ("missing", "union_tag_not_found")
            else "invalid_type" if _is_type_error(worst) else "invalid_value")
    return invalid_request(f"{path}: {message}", code, path or None)


def _is_type_error(error: Any) -> bool:
    """Not the kind of value the field takes: another JSON type, text that is no JSON, or a value that is not
    a string where the field takes one of some strings (every Literal of the bodies is of strings)."""
    kind = error["type"]
    return (kind.endswith("_type") or kind in ("int_from_float", "json_invalid")
            or (kind == "literal_error" and not isinstance(error["input"], str)))


def _path(loc: tuple[int | str, ...], body: Any, missing: bool) -> str:
    """A pydantic location as a JSON path into the body. Locations also name union members ("str",
    "list[...]", a tag): those are the steps the body itself does not have, and are left out, but for
    the last step of a missing field's location, which is that field."""
    path, value = "", body
    for i, step in enumerate(loc):
        if isinstance(step, int) and isinstance(value, list) and step < len(value):
            path, value = f"{path}[{step}]", value[step]
        elif isinstance(step, str) and isinstance(value, dict) and (step in value or missing and i == len(loc) - 1):
            path, value = f"{path}.{step}" if path else step, value.get(step)
    return path


def renamed_param(body: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """An error body whose param names a chat field (max_tokens, messages), named as the adapter's body
    names it. A name ending in "[" renames a prefix: the indices after it mean the same in both bodies. "[*]"
    in a name stands for any index, kept in the new name ("tools[*].function.parameters": "tools[*].parameters")."""
    param = body["error"].get("param") or ""
    for old, new in names.items():
        index = re.fullmatch(re.escape(old).replace(r"\[\*\]", r"(\[\d+\])"), param) if "[*]" in old else None
        if index is not None:
            return {"error": body["error"] | {"param": new.replace("[*]", index[1])}}
        if param == old or (old.endswith("[") and param.startswith(old)):
            return {"error": body["error"] | {"param": new + param[len(old):]}}
    return body


def pass_through(body: dict[str, Any]) -> dict[str, Any]:
    """The LSE fields a body carries, for the chat body."""
    return {name: body[name] for name in LSE_FIELDS if body.get(name) is not None}


# ---- the core's streamed chunks, read back ----

@dataclass
class CoreDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)   # OpenAI's, each whole


def core_delta(chunk: dict[str, Any]) -> CoreDelta:
    if not chunk.get("choices"):
        return CoreDelta()
    choice = chunk["choices"][0]   # a chat chunk's delta, or a completion chunk's text (its choice itself)
    delta = choice.get("delta") or {"content": choice.get("text"), "reasoning_content": choice.get("reasoning_content")}
    calls = [{k: v for k, v in call.items() if k != "index"} for call in delta.get("tool_calls") or []]
    return CoreDelta(delta.get("content") or "", delta.get("reasoning_content") or "", calls)


@dataclass
class CoreEnd:
    """How a reply ended, from a stream's closing chunks: the spec's stop_reason and LSE's fields."""

    stop_reason: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int
    lse: dict[str, Any]     # lse_context, timings and lse_warnings (when any), as the core shaped them
    stop_string: str | None   # the stop string that ended the reply (stop_reason stop_sequence)


def core_end(closing: list[dict[str, Any]], stop_string: str | None) -> tuple[list[CoreDelta], CoreEnd]:
    """The deltas a closing list still carries, and the ending (the core asked for the usage chunk);
    ``stop_string`` is the sequence's, which no chat chunk carries."""
    final = next(c for c in closing if "lse_context" in c)
    usage = next(c["usage"] for c in closing if c.get("usage"))
    choice = final["choices"][0]
    lse = {k: final[k] for k in ("lse_context", "timings", "lse_warnings") if k in final}
    end = CoreEnd(choice["stop_reason"], choice["finish_reason"], usage["prompt_tokens"],
                  usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                  usage["completion_tokens_details"]["reasoning_tokens"], lse, stop_string)
    return [core_delta(c) for c in closing if c is not final], end


class Translation(Protocol):
    """One request in flight, in an adapter's shapes: each core delta becomes stream events (the first
    opens the stream, which may report the prompt's size; every reply feeds one, empty or not); the end
    becomes the closing events and the whole response; an error after the stream has started becomes a
    stream event."""

    stream: bool
    started: bool     # the first delta has been fed

    def feed(self, delta: CoreDelta, prompt_tokens: int) -> list[dict[str, Any]]: ...

    def finish(self, end: CoreEnd) -> tuple[list[dict[str, Any]], dict[str, Any]]: ...

    def stream_error(self, body: dict[str, Any], status: int) -> dict[str, Any] | list[dict[str, Any]]:
        """The stream event that carries an error after the stream has started (or the events, in order)."""
