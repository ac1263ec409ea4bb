"""LSE's OpenAI JSON, in one place: request bodies -> GenerationRequest, and finished or streaming
replies -> response objects and chunks. The HTTP server and lse_request both use this module, so a
client sees the same JSON either way. An error, streamed or not, is ``LSEError.body()``.

What the engine side fills in:

  TokenLogprob  one reply token: its bytes, log-probability, and the top alternatives (bytes, logprob)
  Choice        the reply: text (with echo, the prompt text first), reasoning (the <think> text, None
                when the reply had no reasoning), tool_calls (OpenAI's message.tool_calls entries),
                stop_reason (stop_token, stop_sequence, max_tokens, context_full or cancelled; the
                finish_reason is derived from it), logprobs when the request asked for them
  Usage         prompt tokens (the whole prompt, cached ones included), reply tokens, cached tokens
  Timings       prompt tokens computed and their milliseconds; reply tokens and their milliseconds
  LSEWarning    one lse_warnings entry: a CPU fallback cause and how often this request ran it, or a reply
                whose structured output was cut short
  Outcome       all of the above for a finished reply, plus the context length

``Reply(request, model)`` shapes one reply: ``.response(outcome)`` for a whole reply, or
``.chunk(...)`` per streamed delta and ``.final_chunks(outcome)`` at the end of a stream.

Parsing follows OpenAI: unknown fields are ignored, null means not sent. Every type or range error
is a 400 invalid_request_error whose code is missing_field, invalid_type or invalid_value and whose
param is the field's path ("messages[2].content", "stop[1]"). One choice per request: n > 1 and
several prompts in one request are refused.
"""

from __future__ import annotations

import codecs
import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lse_core.adapters.common import integral
from lse_core.errors import LSEError, invalid_request
from lse_core.limits import lse_context
from lse_core.sampling import GenerationDefaults

ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = {"chat": 20, "completion": 5}
INT64_MAX = 2**63 - 1   # integer fields hold 64-bit values, as OpenAI's do
TOOL_CHOICES = ("none", "auto", "required")


# ---- requests ----

@dataclass
class GenerationRequest:
    """A parsed /v1/chat/completions or /v1/completions body. None means not sent."""

    endpoint: str                                   # "chat" or "completion"
    body: dict[str, Any]                            # the raw body, for the thinking resolver
    model: str | None = None
    messages: list[dict[str, Any]] | None = None    # chat: content always a string
    prompt: str | list[int] | None = None           # completion: text or token ids
    stream: bool = False
    include_usage: bool = False
    stop: tuple[str, ...] = ()
    max_tokens: int | None = None                   # max_tokens, else max_completion_tokens
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool = False                        # vLLM's and llama.cpp's: end-of-turn tokens do not end it
    logprobs: bool = False
    top_logprobs: int = 0                           # alternatives per token, when logprobs
    echo: bool = False                              # completion: return the prompt before the reply
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    constraint: OutputConstraint | None = None       # structured output: what the reply must match

    @property
    def prompt_param(self) -> str:
        """The field a prompt error names: messages or prompt."""
        return "messages" if self.endpoint == "chat" else "prompt"


@dataclass(frozen=True)
class OutputConstraint:
    """What a reply must match (lse_core.structured compiles it). kind: json_schema (value: the schema),
    regex (a pattern), choice (a list of strings), lark or gbnf (a grammar's text); param: the field it
    came from, which an error about it names; strict: OpenAI's json_schema.strict."""

    kind: str
    value: Any
    param: str
    strict: bool = False


# The fields that ask for structured output, one per request: OpenAI's, vLLM's and llama.cpp's.
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "grammar", "json_schema")
STRUCTURED_OUTPUT_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark",
                          "json_object": "json_object"}


def parse_chat(body: object) -> GenerationRequest:
    """A /v1/chat/completions body, checked; raises LSEError (400) naming the offending field."""
    body = _object_body(body)
    request = _parse_common(body, "chat")
    request.messages = _messages(body.get("messages"))
    logprobs = _optional(body, "logprobs", _boolean) or False
    top_logprobs = _optional(body, "top_logprobs", _integer, 0, MAX_TOP_LOGPROBS["chat"]) or 0
    if top_logprobs and not logprobs:
        raise invalid_request("top_logprobs needs logprobs: true", "invalid_value", "top_logprobs")
    request.logprobs, request.top_logprobs = logprobs, top_logprobs
    request.tools = _optional(body, "tools", _tools)
    request.tool_choice = _optional(body, "tool_choice", _tool_choice)
    request.parallel_tool_calls = _optional(body, "parallel_tool_calls", _boolean) is not False
    request.chat_template_kwargs = _optional(body, "chat_template_kwargs", _object)
    return request


def parse_completion(body: object) -> GenerationRequest:
    """A /v1/completions body, checked; raises LSEError (400) naming the offending field."""
    body = _object_body(body)
    request = _parse_common(body, "completion")
    request.prompt = _prompt(body.get("prompt"))
    top_logprobs = _optional(body, "logprobs", _integer, 0, MAX_TOP_LOGPROBS["completion"])
    request.logprobs, request.top_logprobs = top_logprobs is not None, top_logprobs or 0
    request.echo = _optional(body, "echo", _boolean) or False
    return request


@dataclass
class TokenizeRequest:
    """A /tokenize body: a chat body (messages) or a completion body (prompt), whose prompt is
    tokenized as that request would be, or llama.cpp's plain ``content``."""

    request: GenerationRequest | None     # None for content
    content: str
    add_special: bool | None              # None: as the request would (a completion's prompt only)
    add_generation_prompt: bool
    with_pieces: bool                     # each token with its text, as llama.cpp gives it


def parse_tokenize(body: object) -> TokenizeRequest:
    """A /tokenize body, checked; add_special is llama.cpp's name, add_special_tokens vLLM's."""
    body = _object_body(body)
    request, content = None, ""
    if body.get("messages") is not None:
        request = parse_chat(body)
    elif body.get("prompt") is not None:
        request = parse_completion(body)
    else:
        content = body.get("content")
        if not isinstance(content, str):
            raise invalid_request("send content (text), prompt (a completion's) or messages (a chat's)",
                                  "missing_field" if content is None else "invalid_type", "content")
    add_special = _optional(body, "add_special", _boolean)
    if add_special is None:
        add_special = _optional(body, "add_special_tokens", _boolean)
    add_generation_prompt = _optional(body, "add_generation_prompt", _boolean)
    return TokenizeRequest(request, content, add_special, add_generation_prompt is not False,
                           _optional(body, "with_pieces", _boolean) or False)


def _object_body(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid_request(f"the request body must be a JSON object, got {_json_type(body)}",
                              "invalid_type", None)
    return body


def _parse_common(body: dict[str, Any], endpoint: str) -> GenerationRequest:
    n = _optional(body, "n", _integer, 1)
    if n is not None and n > 1:
        raise invalid_request("n must be 1: LSE returns one choice per request; send n requests instead",
                              "invalid_value", "n")
    _refuse_unsupported(body, endpoint)
    stream_options = _optional(body, "stream_options", _object) or {}
    max_tokens = _optional(body, "max_tokens", _integer, 1)
    max_completion_tokens = _optional(body, "max_completion_tokens", _integer, 1)
    return GenerationRequest(
        endpoint=endpoint,
        body=body,
        model=_optional(body, "model", _string),
        stream=_optional(body, "stream", _boolean) or False,
        include_usage=_optional(stream_options, "include_usage", _boolean, path="stream_options") or False,
        stop=_stop(body.get("stop")),
        max_tokens=max_completion_tokens if max_tokens is None else max_tokens,
        temperature=_optional(body, "temperature", _number),
        top_k=_optional(body, "top_k", _integer, -1),
        top_p=_optional(body, "top_p", _number, 0.0, 1.0),
        min_p=_optional(body, "min_p", _number, 0.0, 1.0),
        presence_penalty=_optional(body, "presence_penalty", _number),
        repetition_penalty=_optional(body, "repetition_penalty", _positive_number),
        frequency_penalty=_optional(body, "frequency_penalty", _number),
        seed=_optional(body, "seed", _integer, 0),
        ignore_eos=_optional(body, "ignore_eos", _boolean) or False,
        constraint=_output_constraint(body),
    )


def _output_constraint(body: dict[str, Any]) -> OutputConstraint | None:
    """The reply's constraint: response_format (json_object, json_schema), vLLM's structured_outputs (json,
    regex, choice, grammar), or llama.cpp's grammar (GBNF) and json_schema; at most one of them."""
    found = []
    response_format = _optional(body, "response_format", _object)
    if response_format is not None:
        found.append(_response_format(response_format))
    structured = _optional(body, "structured_outputs", _object)
    if structured is not None:
        found.append(_structured_outputs(structured))
    if body.get("grammar") is not None:
        found.append(OutputConstraint("gbnf", _grammar_text(body["grammar"], "grammar"), "grammar"))
    if body.get("json_schema") is not None:
        found.append(OutputConstraint("json_schema", _schema(body["json_schema"], "json_schema"), "json_schema"))
    found = [c for c in found if c is not None]
    if len(found) > 1:
        raise invalid_request(f"{found[1].param.split('.')[0]} and {found[0].param.split('.')[0]} both constrain the "
                              "reply; send one", "invalid_value", found[1].param.split(".")[0])
    return found[0] if found else None


def _response_format(value: dict[str, Any]) -> OutputConstraint | None:
    kind = _optional(value, "type", _string, path="response_format") or "text"
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputConstraint("json_schema", {"type": "object"}, "response_format")
    if kind != "json_schema":
        raise invalid_request(f"response_format.type must be text, json_object or json_schema, got {kind!r:.40}",
                              "invalid_value", "response_format.type")
    spec = _required(value, "json_schema", _object, "response_format")
    _optional(spec, "name", _string, path="response_format.json_schema")
    strict = _optional(spec, "strict", _boolean, path="response_format.json_schema") or False
    schema = spec.get("schema")
    param = "response_format.json_schema.schema"
    return OutputConstraint("json_schema", {"type": "object"} if schema is None else _schema(schema, param), param,
                            strict)


def _structured_outputs(value: dict[str, Any]) -> OutputConstraint | None:
    given = [key for key in STRUCTURED_OUTPUT_KEYS if value.get(key) is not None]
    if len(given) != 1:
        raise invalid_request(f"structured_outputs takes exactly one of {', '.join(STRUCTURED_OUTPUT_KEYS)}, got "
                              f"{', '.join(given) or 'none'}", "invalid_value", "structured_outputs")
    key = given[0]
    param = f"structured_outputs.{key}"
    raw = value[key]
    match key:
        case "json":
            schema = json.loads(raw) if _is_json_text(raw) else raw
            return OutputConstraint("json_schema", _schema(schema, param), param)
        case "json_object":
            return OutputConstraint("json_schema", {"type": "object"}, param) if _boolean(raw, param) else None
        case "choice":
            choices = _array(raw, param)
            if not choices:
                raise invalid_request(f"{param} must not be empty", "invalid_value", param)
            return OutputConstraint("choice", [_string(c, f"{param}[{i}]") for i, c in enumerate(choices)], param)
    return OutputConstraint(STRUCTURED_OUTPUT_KEYS[key], _grammar_text(raw, param), param)


def _is_json_text(value: Any) -> bool:
    """vLLM takes a schema as an object or as its JSON text."""
    if not isinstance(value, str):
        return False
    try:
        json.loads(value)
    except ValueError:
        return False
    return True


def _schema(value: Any, path: str) -> dict[str, Any] | bool:
    if isinstance(value, bool):   # true: any JSON value; false: none
        return value
    return _object(value, path)


def _grammar_text(value: Any, path: str) -> str:
    if not _string(value, path).strip():
        raise invalid_request(f"{path} must not be empty", "invalid_value", path)
    return value


def _refuse_unsupported(body: dict[str, Any], endpoint: str) -> None:
    """OpenAI fields LSE does not implement, refused when they would change the reply: ignoring
    them would hand the client something other than what it asked for."""
    if _optional(body, "logit_bias", _object):
        raise invalid_request("logit_bias is not supported", "invalid_value", "logit_bias")
    if endpoint == "completion":
        if _optional(body, "suffix", _string):
            raise invalid_request("suffix is not supported: LSE completes after the prompt only",
                                  "invalid_value", "suffix")
        best_of = _optional(body, "best_of", _integer, 1)
        if best_of is not None and best_of > 1:
            raise invalid_request("best_of must be 1: LSE returns one choice per request", "invalid_value",
                                  "best_of")


def _messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise invalid_request("messages is required", "missing_field", "messages")
    if not isinstance(value, list):
        raise _type_error("messages", "an array of messages", value)
    if not value:
        raise invalid_request("messages must not be empty", "invalid_value", "messages")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(value)]


def _message(value: Any, path: str) -> dict[str, Any]:
    """One message, normalized for templates: content a string; an assistant's tool_calls and
    reasoning_content, a tool message's tool_call_id and any name kept."""
    value = _object(value, path)
    role = _required(value, "role", _string, path)
    if role not in ROLES:
        raise invalid_request(f"{path}.role must be one of {', '.join(ROLES)}, got {role!r:.40}",
                              "invalid_value", f"{path}.role")
    content = value.get("content")
    if content is None and role != "assistant":   # an assistant turn may hold only tool calls
        raise invalid_request(f"{path}.content is required", "missing_field", f"{path}.content")
    message: dict[str, Any] = {"role": role, "content": "" if content is None else _content(content, path)}
    kept = {"name": _string}
    if role == "assistant":
        kept |= {"tool_calls": _tool_calls, "reasoning_content": _string}
    if role == "tool":
        kept |= {"tool_call_id": _string}
    for name, check in kept.items():
        if value.get(name) is not None:
            message[name] = check(value[name], f"{path}.{name}")
    return message


def _content(value: Any, message_path: str) -> str:
    """A string, or text parts joined with newlines (as vLLM joins them for string templates)."""
    path = f"{message_path}.content"
    if isinstance(value, str):
        return _string(value, path)
    if not isinstance(value, list):
        raise _type_error(path, "a string or an array of text parts", value)
    texts = []
    for j, part in enumerate(value):
        part_path = f"{path}[{j}]"
        part = _object(part, part_path)
        kind = _required(part, "type", _string, part_path)
        if kind != "text":
            raise invalid_request(f"{part_path}.type {kind!r:.40} is not supported; only text parts are",
                                  "invalid_value", f"{part_path}.type")
        texts.append(_required(part, "text", _string, part_path))
    return "\n".join(texts)


class CallArguments(dict):
    """An earlier call's arguments as templates want them. OpenAI sends JSON text; most templates iterate
    the arguments or write them with tojson (so they need the object), some add them to a string (so
    they need the text, as DeepSeek's do). This is the object, and the text where a string is wanted."""

    def __init__(self, text: str, parsed: dict[str, Any]) -> None:
        super().__init__(parsed)
        self.text = text

    def __str__(self) -> str:
        return self.text

    def __add__(self, other: Any) -> Any:
        return self.text + other if isinstance(other, str) else NotImplemented

    def __radd__(self, other: Any) -> Any:
        return other + self.text if isinstance(other, str) else NotImplemented


def _tool_calls(value: Any, path: str) -> list[dict[str, Any]]:
    """An assistant's earlier calls, with JSON-object arguments as CallArguments."""
    calls = []
    for i, call in enumerate(_array(value, path)):
        function = _required(_object(call, f"{path}[{i}]"), "function", _object, f"{path}[{i}]")
        _required(function, "name", _string, f"{path}[{i}].function")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                call = call | {"function": function | {"arguments": CallArguments(arguments, parsed)}}
        calls.append(call)
    return calls


def _tools(value: Any, path: str) -> list[dict[str, Any]]:
    tools = _array(value, path)
    for i, tool in enumerate(tools):
        tool_path = f"{path}[{i}]"
        if _required(_object(tool, tool_path), "type", _string, tool_path) != "function":
            raise invalid_request(f"{tool_path}.type must be function", "invalid_value", f"{tool_path}.type")
        function = _required(tool, "function", _object, tool_path)
        _required(function, "name", _string, f"{tool_path}.function")
        _optional(function, "parameters", _object, path=f"{tool_path}.function")
    return tools


def _tool_choice(value: Any, path: str) -> str | dict[str, Any]:
    if isinstance(value, str):
        if _string(value, path) not in TOOL_CHOICES:
            raise invalid_request(f"{path} must be one of {', '.join(TOOL_CHOICES)} or a function, "
                                  f"got {value!r:.40}", "invalid_value", path)
        return value
    choice = _object(value, path)
    if _optional(choice, "type", _string, path=path) not in (None, "function"):
        raise invalid_request(f"{path}.type must be function", "invalid_value", f"{path}.type")
    _required(_required(choice, "function", _object, path), "name", _string, f"{path}.function")
    return choice


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (_stop_string(_string(value, "stop"), "stop"),)
    if not isinstance(value, list):
        raise _type_error("stop", "a string or an array of strings", value)
    if len(value) > MAX_STOP_STRINGS:
        raise invalid_request(f"stop holds at most {MAX_STOP_STRINGS} strings, got {len(value)}",
                              "invalid_value", "stop")
    return tuple(_stop_string(_string(s, f"stop[{i}]"), f"stop[{i}]") for i, s in enumerate(value))


def _stop_string(value: str, path: str) -> str:
    if not value:
        raise invalid_request(f"{path} must not be empty", "invalid_value", path)
    return value


def _prompt(value: Any) -> str | list[int]:
    """A string or a list of token ids; a one-element batch ([text] or [[ids]]) is that prompt."""
    if value is None:
        raise invalid_request("prompt is required", "missing_field", "prompt")
    path = "prompt"
    if isinstance(value, list) and value and isinstance(value[0], str | list):
        if len(value) > 1:
            raise invalid_request("several prompts in one request are not supported; send one per request",
                                  "invalid_value", "prompt")
        value, path = value[0], "prompt[0]"
    if isinstance(value, str):
        if not _string(value, path):
            raise invalid_request(f"{path} must not be empty", "invalid_value", path)
        return value
    if not isinstance(value, list):
        raise _type_error(path, "a string or an array of token ids", value)
    if not value:
        raise invalid_request(f"{path} must not be empty", "invalid_value", path)
    return [_integer(t, f"{path}[{i}]", 0) for i, t in enumerate(value)]


# ---- field checks: each takes the value and its path, returns the value or raises ----

def _optional(body: dict[str, Any], name: str, check: Callable[..., Any], *bounds: Any,
              path: str | None = None) -> Any:
    """The checked field, or None when it is absent or null."""
    value = body.get(name)
    return None if value is None else check(value, f"{path}.{name}" if path else name, *bounds)


def _required(body: dict[str, Any], name: str, check: Callable[..., Any], path: str) -> Any:
    value = body.get(name)
    if value is None:
        raise invalid_request(f"{path}.{name} is required", "missing_field", f"{path}.{name}")
    return check(value, f"{path}.{name}")


def _string(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise _type_error(path, "a string", value)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:   # JSON's "\ud800" escapes decode to lone surrogates no tokenizer takes
        raise invalid_request(f"{path} is not valid Unicode: it holds a lone surrogate",
                              "invalid_value", path) from None
    return value


def _boolean(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise _type_error(path, "a boolean", value)
    return value


def _object(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _type_error(path, "an object", value)
    return value


def _array(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise _type_error(path, "an array", value)
    return value


def _integer(value: Any, path: str, minimum: int = -INT64_MAX - 1, maximum: int = INT64_MAX) -> int:
    value = integral(value)   # JSON has one number type: 2.0 is the integer 2
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(path, "an integer", value)
    if not minimum <= value <= maximum:
        raise invalid_request(f"{path} must be {_range_text(minimum, maximum, INT64_MAX)}, got "
                              f"{value if abs(value) <= INT64_MAX + 1 else 'an integer beyond 64 bits'}",
                              "invalid_value", path)
    return value


def _number(value: Any, path: str, minimum: float = -math.inf, maximum: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _type_error(path, "a number", value)
    try:
        number = float(value)
    except OverflowError:   # an integer beyond any float
        number = math.inf
    if not math.isfinite(number):
        raise invalid_request(f"{path} must be a finite number", "invalid_value", path)
    if not minimum <= number <= maximum:
        raise invalid_request(f"{path} must be {_range_text(minimum, maximum, math.inf)}, got {number:g}",
                              "invalid_value", path)
    return number


def _positive_number(value: Any, path: str) -> float:
    number = _number(value, path)
    if number <= 0:
        raise invalid_request(f"{path} must be greater than 0, got {number:g}", "invalid_value", path)
    return number


def _range_text(minimum: float, maximum: float, unbounded: float) -> str:
    if maximum == unbounded:
        return f"at least {minimum}"
    return f"between {minimum} and {maximum}"


def _type_error(path: str, expected: str, value: Any) -> LSEError:
    return invalid_request(f"{path} must be {expected}, got {_json_type(value)}", "invalid_type", path)


def _json_type(value: Any) -> str:
    match value:
        case None:
            return "null"
        case bool():
            return "a boolean"
        case int() | float():
            return "a number"
        case str():
            return "a string"
        case list():
            return "an array"
        case dict():
            return "an object"
    return type(value).__name__


# ---- what the engine hands back ----

@dataclass
class TokenLogprob:
    token: bytes                                    # what it adds to the text: maybe part of a character
    logprob: float | None                           # None for an echoed prompt's first token
    top: list[tuple[bytes, float]] = field(default_factory=list)


def token_text(token: bytes) -> str:
    """A token as logprobs name it. One that holds part of a UTF-8 character is named as OpenAI does,
    "bytes:" and its bytes escaped ("bytes:\\xe2\\x80"), so two such tokens never share a name."""
    text = _utf8(token)
    return text if text is not None else "bytes:" + token.decode("utf-8", errors="backslashreplace")


def _utf8(token: bytes) -> str | None:
    try:
        return token.decode("utf-8")
    except UnicodeDecodeError:
        return None


class TextOffsets:
    """Completion logprobs' text_offset: the character of the text (decoded with U+FFFD for bad
    bytes) where each token's first byte lands. Bytes of an unfinished character wait in the decoder:
    a token that continues them starts inside that character; any other ends it as U+FFFD first."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0     # characters the decoder has given out

    def of(self, tokens: list[TokenLogprob]) -> list[int]:
        offsets = []
        for t in tokens:
            waiting = self._decoder.getstate()[0]
            ended = len(waiting.decode("utf-8", errors="replace"))
            if waiting and len((waiting + t.token[:1]).decode("utf-8", errors="replace")) == ended:
                ended -= 1      # the first byte continues the waiting character
            offsets.append(self._chars + ended)
            self._chars += len(self._decoder.decode(t.token))
        return offsets


@dataclass
class Choice:
    stop_reason: str
    text: str = ""
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0     # of the completion tokens, those written inside the reasoning block

    def to_json(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
                "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens}}


@dataclass
class Timings:
    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float

    def to_json(self) -> dict[str, Any]:
        return {"prompt_n": self.prompt_n, "prompt_ms": self.prompt_ms,
                "prompt_per_second": _per_second(self.prompt_n, self.prompt_ms),
                "predicted_n": self.predicted_n, "predicted_ms": self.predicted_ms,
                "predicted_per_second": _per_second(self.predicted_n, self.predicted_ms)}


@dataclass
class LSEWarning:
    """One lse_warnings entry: a CPU fallback cause and how often this request ran it, or (count None)
    another warning about the reply, such as structured output cut short."""

    cause: str
    count: int | None
    type: str = "cpu_fallback"

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"type": self.type, "cause": self.cause}
        return body if self.count is None else body | {"count": self.count}


@dataclass
class Outcome:
    choice: Choice
    usage: Usage
    context_length: int
    timings: Timings
    warnings: list[LSEWarning] = field(default_factory=list)


def _per_second(n: int, ms: float) -> float:
    return n * 1000.0 / ms if ms > 0 else 0.0


FINISH_REASONS: dict[str, str | None] = {
    "stop_token": "stop", "stop_sequence": "stop", "max_tokens": "length", "context_full": "length",
    "cancelled": None,
}


def finish_reason(choice: Choice) -> str | None:
    """OpenAI's finish_reason for a stop_reason: tool_calls when an end-of-turn followed a tool call."""
    if choice.stop_reason == "stop_token" and choice.tool_calls:
        return "tool_calls"
    return FINISH_REASONS[choice.stop_reason]


# ---- responses and chunks ----

class Reply:
    """The JSON of one reply, whole or streamed. Every chunk repeats the id, created and model."""

    def __init__(self, request: GenerationRequest, model: str) -> None:
        self.request = request
        self.model = model
        self.chat = request.endpoint == "chat"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._role_sent = False    # a chat stream's first chunk carries the role
        self._stream_offsets = TextOffsets()   # a stream's text_offset counts across chunks

    def response(self, outcome: Outcome) -> dict[str, Any]:
        """A chat.completion or text_completion object."""
        choice = outcome.choice
        if self.chat:
            message: dict[str, Any] = {"role": "assistant",
                                       "content": None if choice.tool_calls and not choice.text else choice.text}
            if choice.reasoning is not None:
                message["reasoning_content"] = choice.reasoning
            if choice.tool_calls:
                message["tool_calls"] = choice.tool_calls
            shaped: dict[str, Any] = {"index": 0, "message": message}
        else:
            shaped = {"index": 0, "text": choice.text}
            if choice.reasoning is not None:
                shaped["reasoning_content"] = choice.reasoning
        shaped |= {"finish_reason": finish_reason(choice), "stop_reason": choice.stop_reason,
                   "logprobs": self._logprobs(choice.logprobs or [], TextOffsets())}
        body = self._envelope("chat.completion" if self.chat else "text_completion", [shaped])
        body["usage"] = outcome.usage.to_json()
        return body | self._closing(outcome)

    def chunk(self, text: str = "", reasoning: str = "", logprobs: list[TokenLogprob] | None = None,
              tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """One streamed delta. The first chat chunk carries the role; tool calls come whole, in one chunk."""
        if self.chat:
            delta: dict[str, Any] = {}
            if not self._role_sent:
                delta["role"] = "assistant"
            if text or not self._role_sent:
                delta["content"] = text
            if reasoning:
                delta["reasoning_content"] = reasoning
            if tool_calls:
                delta["tool_calls"] = [{"index": i} | call for i, call in enumerate(tool_calls)]
            self._role_sent = True
            shaped: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            shaped = {"index": 0, "text": text}
            if reasoning:
                shaped["reasoning_content"] = reasoning
        shaped |= {"logprobs": self._logprobs(logprobs or [], self._stream_offsets),
                   "finish_reason": None, "stop_reason": None}
        return self._stream_envelope([shaped])

    def final_chunks(self, outcome: Outcome) -> list[dict[str, Any]]:
        """The end of a stream: the chunk with finish_reason, stop_reason, lse_context, timings and
        lse_warnings, then the usage chunk when stream_options.include_usage (preceded by the role
        chunk when no delta was sent)."""
        chunks = [] if self._role_sent or not self.chat else [self.chunk()]
        choice = outcome.choice
        shaped: dict[str, Any] = {"index": 0, "delta": {}} if self.chat else {"index": 0, "text": ""}
        shaped |= {"logprobs": None, "finish_reason": finish_reason(choice), "stop_reason": choice.stop_reason}
        chunks.append(self._stream_envelope([shaped]) | self._closing(outcome))
        if self.request.include_usage:
            chunks.append(self._envelope(self._chunk_object, []) | {"usage": outcome.usage.to_json()})
        return chunks

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _stream_envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = self._envelope(self._chunk_object, choices)
        if self.request.include_usage:   # as OpenAI: usage null on every chunk but the usage chunk
            body["usage"] = None
        return body

    def _closing(self, outcome: Outcome) -> dict[str, Any]:
        used = outcome.usage.prompt_tokens + outcome.usage.completion_tokens
        closing: dict[str, Any] = {"lse_context": lse_context(used, outcome.context_length),
                                   "timings": outcome.timings.to_json()}
        if outcome.warnings:
            closing["lse_warnings"] = [w.to_json() for w in outcome.warnings]
        return closing

    def _logprobs(self, tokens: list[TokenLogprob], offsets: TextOffsets) -> dict[str, Any] | None:
        """OpenAI's logprobs object for these tokens; null when the request asked for none."""
        if not self.request.logprobs:
            return None
        if self.chat:
            return {"content": [_chat_logprob(t.token, t.logprob) | {
                "top_logprobs": [_chat_logprob(token, logprob) for token, logprob in t.top]} for t in tokens],
                "refusal": None}
        return {"tokens": [token_text(t.token) for t in tokens], "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [{token_text(token): logprob for token, logprob in t.top} for t in tokens],
                "text_offset": offsets.of(tokens)}


def _chat_logprob(token: bytes, logprob: float | None) -> dict[str, Any]:
    return {"token": token_text(token), "logprob": logprob, "bytes": list(token)}


def tokenized(ids: list[int], pieces: list[bytes] | None, context_length: int) -> dict[str, Any]:
    """/tokenize's answer: llama.cpp's tokens (with pieces: {id, piece}, a piece that is no UTF-8 by
    itself as its byte values) and vLLM's count and max_model_len."""
    tokens: list[Any] = list(ids)
    if pieces is not None:
        tokens = [{"id": i, "piece": text if (text := _utf8(p)) is not None else list(p)} for i, p in zip(ids, pieces)]
    return {"tokens": tokens, "count": len(ids), "max_model_len": context_length}


def model_entry(model_id: str, created: int, context_length: int | None, thinking: dict[str, Any] | None,
                defaults: GenerationDefaults | None, structured_outputs: dict[str, Any]) -> dict[str, Any]:
    """One /v1/models entry; ``thinking`` is the template's thinking object as the spec shows it,
    ``structured_outputs`` what lse_core.structured supports. None: not known before the model first loads."""
    return {"id": model_id, "object": "model", "created": created, "owned_by": "lse",
            "context_length": context_length, "thinking": thinking,
            "generation_defaults": defaults.to_json() if defaults is not None else None,
            "structured_outputs": structured_outputs}
