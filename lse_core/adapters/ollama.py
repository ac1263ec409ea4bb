"""Ollama's API (/api/chat, /api/generate, /api/embed, /api/embeddings, /api/tags, /api/show, /api/ps,
/api/version) over the core's requests.

A chat's ``messages`` (tool calls with their arguments as objects, earlier ``thinking``, tool results) and a
generate's ``system`` and ``prompt`` become chat messages (``raw`` prompts a completion instead); ``options``
become the core's sampling fields (num_predict its max_tokens, repeat_penalty its repetition_penalty; num_ctx is
checked against the loaded context; the options LSE has no use for are ignored, as Ollama ignores unknown ones,
each named in lse_warnings); ``format`` the reply's JSON constraint; ``think`` the core's spelling of the switch
or the level, so the template's levels decide as on every endpoint. The core's chunks become Ollama's objects,
streamed one per line; the last one carries Ollama's counters (durations in nanoseconds) beside LSE's
stop_reason, lse_context, timings and lse_warnings. Errors are Ollama's {"error": "<message>"} with LSE's type,
code and param beside it. A shape named as another API's is named Ollama... here: /openapi.json names them all."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from collections import Counter
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal, NotRequired

from pydantic import Field
from typing_extensions import TypedDict  # pydantic reads typing's TypedDict only from Python 3.12

from lse_core.adapters.common import Body, CoreDelta, CoreEnd, Count, Part, checked, pass_through, renamed_param
from lse_core.errors import LSEError, invalid_request
from lse_core.limits import LSEContext
from lse_core.protocol import Closing, LSEWarning, StopReason
from lse_core.tools import tool_call_format

if TYPE_CHECKING:
    from lse_core.api import LSE

# The Ollama release whose API this follows: clients that gate features on /api/version read it.
OLLAMA_VERSION = "0.12.0"
# options and the chat fields they become; num_predict and num_ctx are read on their own
OPTIONS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "seed": "seed",
           "stop": "stop", "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty"}
UNLIMITED_PREDICT = (-1, -2)   # num_predict: no limit, and until the context fills; both are LSE's default
# Chat fields as an Ollama body names them, for the core's errors ("stop[" renames the prefix of stop[1]...).
PARAMS = {"max_tokens": "options.num_predict", "stop[": "options.stop[", "response_format": "format",
          "response_format.json_schema.schema": "format",
          "reasoning_effort": "think", "enable_thinking": "think", "repetition_penalty": "options.repeat_penalty",
          **{field: f"options.{option}" for option, field in OPTIONS.items() if option != "repeat_penalty"}}
DoneReason = Literal["stop", "length", "load", "unload"]
DONE_REASONS: dict[str, DoneReason] = {"stop_token": "stop", "stop_sequence": "stop", "max_tokens": "length",
                                       "context_full": "length", "cancelled": "stop"}
MODEL_MANAGEMENT = ("pull", "push", "create", "copy", "delete")
FOREVER = "9999-12-31T23:59:59Z"   # /api/ps' expires_at of a model that stays loaded
# a keep_alive longer than this (about 31 years; an infinite one too) is forever: a later expiry is past what a
# timestamp can say, and past any timer's range
KEEP_ALIVE_FOREVER_S = 1e9
GO_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


# ---- the requests ----

class ToolCallFunctionParam(Part):
    name: str
    arguments: dict[str, Any] = {}


class ToolCallParam(Part):
    id: str | None = None
    function: ToolCallFunctionParam


class OllamaMessageParam(Part):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


Format = Literal["", "json"] | dict[str, Any]
KeepAlive = float | str      # seconds, or a Go duration ("5m", "1h30m"); negative: forever


class GenerationParams(Body):
    """What /api/chat and /api/generate share. LSE's own fields (min_p, thinking_budget, ...) pass through."""

    model: str | None = None
    stream: bool | None = None
    format: Format | None = None
    options: dict[str, Any] | None = None
    keep_alive: KeepAlive | None = None
    think: bool | str | None = None


class ChatRequest(GenerationParams):
    messages: list[OllamaMessageParam] = []
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(GenerationParams):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool | None = None
    images: list[str] | None = None


class EmbedRequest(Body):
    model: str | None = None
    input: str | list[str]
    truncate: bool | None = None
    dimensions: int | None = None
    options: dict[str, Any] | None = None
    keep_alive: KeepAlive | None = None


class OllamaEmbeddingsRequest(Body):
    """The legacy /api/embeddings: one prompt."""

    model: str | None = None
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: KeepAlive | None = None


class ShowRequest(Body):
    model: str | None = Field(None, description="the model, or its older name field")
    name: str | None = None
    verbose: bool | None = None


def show_model(body: Any) -> str | None:
    """The model an /api/show body names (by model, or the older name); raises LSEError."""
    req = checked(ShowRequest, body)
    return req.model or req.name


def keep_alive(body: Any) -> float | None:
    """The seconds a body's keep_alive asks the model to stay loaded once idle (negative: forever, as is a time
    past KEEP_ALIVE_FOREVER_S); None when it names none. Raises LSEError for a value that is no duration."""
    value = body.get("keep_alive") if isinstance(body, dict) else None
    if value is None:
        return None
    seconds = _duration(value)
    if seconds is None or math.isnan(seconds):
        raise invalid_request(f"keep_alive must be a number of seconds or a duration such as \"5m\" or \"1h30m\", "
                              f"got {value!r:.40}", "invalid_value", "keep_alive")
    return -1.0 if seconds > KEEP_ALIVE_FOREVER_S else seconds


def _duration(value: Any) -> float | None:
    """Seconds of a number, or of a string holding one or a Go duration ("-1m", "1h30m"); None for anything else."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            return float(text)
        except ValueError:
            pass
        sign, digits = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.removeprefix("+"))
        if digits and GO_DURATION.sub("", digits) == "":
            return sign * sum(float(n) * GO_UNITS[unit] for n, unit in GO_DURATION.findall(digits))
    return None


def loads_only(body: Any, endpoint: Literal["chat", "generate"]) -> bool:
    """An empty request, which only loads the model (or with keep_alive 0 unloads it), as Ollama's do; raises
    LSEError for a body that is no request (so it loads nothing)."""
    if endpoint == "chat":
        return not checked(ChatRequest, body).messages
    req = checked(GenerateRequest, body)
    return not req.prompt and not req.images


def chat_start(body: Any, model_id: str, context_length: int) -> tuple[dict[str, Any], OllamaTranslation]:
    """An /api/chat body as the chat body to run and the translation of its reply; raises LSEError."""
    req = checked(ChatRequest, body)
    messages = []
    for i, message in enumerate(req.messages):
        _no_images(message.images, f"messages[{i}].images")
        messages.append(_chat_message(message))
    chat, warnings = _generation_body(req, body, context_length)
    chat |= {"messages": messages, "tools": req.tools}
    return _present(chat), OllamaTranslation("chat", req.model or model_id, req.stream is not False, warnings)


def generate_start(body: Any, model_id: str, context_length: int) -> tuple[dict[str, Any], OllamaTranslation]:
    """An /api/generate body as the chat body to run (a completion's, with a prompt, for raw) and the
    translation of its reply; raises LSEError."""
    req = checked(GenerateRequest, body)
    _no_images(req.images, "images")
    for name in ("suffix", "template", "context"):
        if getattr(req, name):
            raise invalid_request(f"{name} is not supported: {_UNSUPPORTED[name]}", "invalid_value", name)
    chat, warnings = _generation_body(req, body, context_length)
    if req.raw:
        if req.system:
            raise invalid_request("system has no place in a raw prompt: write it into the prompt", "invalid_value",
                                  "system")
        chat["prompt"] = req.prompt
    else:
        system = [{"role": "system", "content": req.system}] if req.system else []
        chat["messages"] = system + [{"role": "user", "content": req.prompt}]
    return _present(chat), OllamaTranslation("generate", req.model or model_id, req.stream is not False, warnings)


_UNSUPPORTED = {"suffix": "LSE completes after the prompt only",
                "template": "the model's own chat template renders the prompt (or send raw: true)",
                "context": "send the conversation's messages to /api/chat instead"}


def _no_images(images: list[str] | None, param: str) -> None:
    if images:
        raise invalid_request("images are not supported: LSE serves text models, without image input", "invalid_value",
                              param)


def _chat_message(message: OllamaMessageParam) -> dict[str, Any]:
    """An Ollama message as a chat message: earlier calls' arguments as JSON text, earlier thinking as
    reasoning_content, a tool result's tool_name as its name."""
    chat: dict[str, Any] = {"role": message.role, "content": message.content or ""}
    if message.thinking:
        chat["reasoning_content"] = message.thinking
    if message.tool_calls:
        chat["tool_calls"] = [{"id": call.id or f"call_{i}", "type": "function", "function": {
            "name": call.function.name, "arguments": json.dumps(call.function.arguments)}}
            for i, call in enumerate(message.tool_calls)]
    if message.tool_name:
        chat["name"] = message.tool_name
    if message.tool_call_id:
        chat["tool_call_id"] = message.tool_call_id
    return chat


def _generation_body(req: GenerationParams, body: dict[str, Any], context_length: int
                     ) -> tuple[dict[str, Any], list[LSEWarning]]:
    """The chat fields of ``options``, ``format`` and ``think``, and a warning per option that is ignored."""
    chat, warnings = _options(req.options or {}, context_length)
    chat |= {"model": req.model, "response_format": _response_format(req.format)} | pass_through(body)
    if isinstance(req.think, bool):
        chat["enable_thinking"] = req.think
    elif req.think is not None:
        chat["reasoning_effort"] = req.think
    return chat, warnings


def _options(options: dict[str, Any], context_length: int) -> tuple[dict[str, Any], list[LSEWarning]]:
    _check_num_ctx(options, context_length)
    chat = {field: options.get(option) for option, field in OPTIONS.items()}
    predict = options.get("num_predict")
    if predict is not None:
        if not _integral(predict) or (predict < 1 and predict not in UNLIMITED_PREDICT):
            raise invalid_request(f"options.num_predict must be a positive number of tokens, or -1 (no limit) or -2 "
                                  f"(until the context fills), got {predict!r:.40}", "invalid_value",
                                  "options.num_predict")
        chat["max_tokens"] = int(predict) if predict > 0 else None
    return chat, _ignored(options, {*OPTIONS, "num_predict", "num_ctx"})


def _check_num_ctx(options: dict[str, Any], context_length: int) -> None:
    """num_ctx may not ask for more context than the model was loaded with; a smaller one changes nothing."""
    num_ctx = options.get("num_ctx")
    if num_ctx is not None and (not _integral(num_ctx) or num_ctx < 1):
        raise invalid_request(f"options.num_ctx must be a positive number of tokens, got {num_ctx!r:.40}",
                              "invalid_value", "options.num_ctx")
    if num_ctx is not None and num_ctx > context_length:
        raise invalid_request(f"options.num_ctx {int(num_ctx)} is more than the {context_length} tokens of context "
                              "this model was loaded with (lse-server --kv-len sets it)", "invalid_value",
                              "options.num_ctx")


def _ignored(options: dict[str, Any], used: set[str]) -> list[LSEWarning]:
    """A warning per option not ``used``: Ollama ignores the options it does not know, and so does LSE."""
    return [LSEWarning(f"options.{name} is not supported by LSE; it was ignored", None, "ignored_option")
            for name in sorted(set(options) - used)]


def _integral(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())


def _response_format(value: Format | None) -> dict[str, Any] | None:
    if not value:
        return None
    if value == "json":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}


def _present(chat: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in chat.items() if v is not None}


def error_body(body: dict[str, Any], status: int = 400) -> OllamaError:
    """An LSEError body as Ollama's {"error": "<message>"}, with the type, code, param (named as the Ollama body
    names it, in the message too) and any extra fields beside it."""
    sent, renamed = body["error"], renamed_param(body, PARAMS)["error"]
    message, param = sent["message"], renamed["param"]
    if param != sent["param"] and message.startswith(sent["param"]):    # "top_p: ..." is "options.top_p: ..."
        message = param + message[len(sent["param"]):]
    extra = {k: v for k, v in renamed.items() if k not in ("message", "param")}
    return OllamaError(error=message, param=param, **extra)


def model_management_error(action: str) -> LSEError:
    """/api/pull, /api/push, /api/create, /api/copy, /api/delete: LSE serves the files it was given."""
    return LSEError(f"/api/{action} is not supported: LSE serves model files given to lse-server (-m PATH, "
                    "--models-dir DIR, --alias ID=PATH); put the file there and restart it", status=501,
                    code="not_supported")


# ---- the replies ----
# Declared once, as the TypedDicts below (lse_core.protocol's convention): the translation builds them.

class ToolCallFunction(TypedDict):
    index: Count
    name: str
    arguments: dict[str, Any]           # an object, not JSON text


class OllamaToolCall(TypedDict):
    id: str
    function: ToolCallFunction


class OllamaReplyMessage(TypedDict):
    role: Literal["assistant"]
    content: str
    thinking: NotRequired[str]
    tool_calls: NotRequired[list[OllamaToolCall]]


class _Part(TypedDict):
    model: str
    created_at: str                     # RFC 3339, UTC
    done: bool


class ChatPart(_Part):
    message: OllamaReplyMessage


class GeneratePart(_Part):
    response: str
    thinking: NotRequired[str]


class Metrics(TypedDict):
    """Ollama's counters, in nanoseconds and tokens."""

    total_duration: Count
    load_duration: Count                # the model was open when the request started: the load is not counted
    prompt_eval_count: Count            # the whole prompt, cached tokens included
    prompt_eval_duration: Count
    eval_count: Count
    eval_duration: Count


class Ending(Metrics, Closing):
    done_reason: DoneReason
    stop_reason: StopReason


class ChatResponse(ChatPart, Ending):
    """The last object of /api/chat's stream, or its whole reply."""


class GenerateResponse(GeneratePart, Ending):
    """The last object of /api/generate's stream, or its whole reply."""


class LoadResponse(_Part):
    """The answer to a request that only loads or unloads the model."""

    done_reason: DoneReason
    message: NotRequired[OllamaReplyMessage]   # /api/chat's
    response: NotRequired[str]           # /api/generate's


class OllamaError(TypedDict):
    """Ollama's error body (also the last line of a stream whose request fails once streaming), with LSE's fields."""

    error: str
    type: str
    code: str | None
    param: str | None
    levels: NotRequired[list[str]]
    lse_context: NotRequired[LSEContext]
    models: NotRequired[list[str]]


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


class OllamaTranslation:
    """The core's deltas as Ollama's objects, one per delta; the counters at the end."""

    def __init__(self, endpoint: Literal["chat", "generate"], model: str, stream: bool,
                 warnings: list[LSEWarning]) -> None:
        self.endpoint = endpoint
        self.model = model
        self.stream = stream
        self.warnings = warnings
        self.started = False
        self.start_ns = time.monotonic_ns()
        self.content: list[str] = []
        self.thinking: list[str] = []
        self.tool_calls: list[OllamaToolCall] = []

    def feed(self, delta: CoreDelta, prompt_tokens: int = 0) -> list[ChatPart | GeneratePart]:
        self.started = True
        calls = [OllamaToolCall(id=call["id"], function=ToolCallFunction(
            index=len(self.tool_calls) + i, name=call["function"]["name"],
            arguments=json.loads(call["function"]["arguments"]))) for i, call in enumerate(delta.tool_calls)]
        self.content.append(delta.content)
        self.thinking.append(delta.reasoning)
        self.tool_calls += calls
        if not (delta.content or delta.reasoning or calls):
            return []
        return [self._part(delta.content, delta.reasoning, calls, done=False)]

    def _part(self, content: str, thinking: str, calls: list[OllamaToolCall], done: bool) -> ChatPart | GeneratePart:
        if self.endpoint == "generate":
            part = GeneratePart(model=self.model, created_at=_now(), response=content, done=done)
            if thinking:
                part["thinking"] = thinking
            return part
        message = OllamaReplyMessage(role="assistant", content=content)
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = calls
        return ChatPart(model=self.model, created_at=_now(), message=message, done=done)

    def finish(self, end: CoreEnd) -> tuple[list[ChatResponse | GenerateResponse], ChatResponse | GenerateResponse]:
        """The last object of the stream (empty, with the counters), and the whole reply."""
        timings = end.lse["timings"]
        warnings = [w.to_json() for w in self.warnings] + end.lse.get("lse_warnings", [])
        closing = {k: v for k, v in end.lse.items() if k != "lse_warnings"} | (
            {"lse_warnings": warnings} if warnings else {})
        ending = Ending(
            total_duration=time.monotonic_ns() - self.start_ns, load_duration=0,
            prompt_eval_count=end.prompt_tokens, prompt_eval_duration=_ns(timings["prompt_ms"]),
            eval_count=end.completion_tokens, eval_duration=_ns(timings["predicted_ms"]),
            done_reason=DONE_REASONS[end.stop_reason], stop_reason=end.stop_reason, **closing)
        whole = self._part("".join(self.content), "".join(self.thinking), self.tool_calls, done=True) | ending
        last = self._part("", "", [], done=True) | ending
        return [last], whole

    def stream_error(self, body: dict[str, Any], status: int) -> OllamaError:
        return error_body(body, status)


def _ns(ms: float) -> int:
    return round(ms * 1_000_000)


def load_response(endpoint: Literal["chat", "generate"], model: str, unloading: bool) -> LoadResponse:
    response = LoadResponse(model=model, created_at=_now(), done=True, done_reason="unload" if unloading else "load")
    if endpoint == "chat":
        response["message"] = OllamaReplyMessage(role="assistant", content="")
    else:
        response["response"] = ""
    return response


# ---- embeddings ----

class EmbedResponse(TypedDict):
    model: str
    embeddings: list[list[float]]
    total_duration: Count
    load_duration: Count
    prompt_eval_count: Count
    lse_warnings: NotRequired[list[dict[str, Any]]]


class EmbeddingResponse(TypedDict):
    """The legacy /api/embeddings' answer."""

    embedding: list[float]


def embeddings_body(body: Any, legacy: bool, context_length: int) -> tuple[dict[str, Any], list[LSEWarning]]:
    """An /api/embed body (``input``), or the ``legacy`` /api/embeddings' (``prompt``), as the /v1/embeddings
    body, and a warning per option ignored (none bears on a vector but num_ctx, checked); raises LSEError."""
    req = checked(OllamaEmbeddingsRequest if legacy else EmbedRequest, body)
    options = req.options or {}
    _check_num_ctx(options, context_length)
    embeddings = {"model": req.model, "input": req.prompt if legacy else req.input}
    if not legacy and req.dimensions is not None:
        embeddings["dimensions"] = req.dimensions
    return _present(embeddings), _ignored(options, {"num_ctx"})


def embed_response(vectors: dict[str, Any], model: str, start_ns: int, warnings: list[LSEWarning]) -> EmbedResponse:
    """/v1/embeddings' answer as /api/embed's."""
    response = EmbedResponse(model=model, embeddings=[item["embedding"] for item in vectors["data"]],
                             total_duration=time.monotonic_ns() - start_ns, load_duration=0,
                             prompt_eval_count=vectors["usage"]["prompt_tokens"])
    if warnings:
        response["lse_warnings"] = [w.to_json() for w in warnings]
    return response


def embedding_response(vectors: dict[str, Any] | None) -> EmbeddingResponse:
    """/v1/embeddings' answer as the legacy /api/embeddings' (None: an empty prompt, which gets no vector)."""
    return EmbeddingResponse(embedding=vectors["data"][0]["embedding"] if vectors else [])


# ---- models ----

class ModelDetails(TypedDict):
    parent_model: str
    format: Literal["gguf", "safetensors"]
    family: str                         # the architecture, once the model has been loaded
    families: list[str] | None
    parameter_size: str                 # "135M", once loaded
    quantization_level: str             # "Q4_0", "F16"..., once loaded


class ListedModel(TypedDict):
    name: str
    model: str
    modified_at: str
    size: Count                         # the weight files' bytes
    digest: str                         # of the path, size and time of the files: it changes when they do
    details: ModelDetails


class OllamaModelList(TypedDict):
    models: list[ListedModel]


class RunningModel(TypedDict):
    name: str
    model: str
    size: Count                         # the memory its load took
    digest: str
    details: ModelDetails
    expires_at: str
    size_vram: Count
    context_length: Count


class RunningList(TypedDict):
    models: list[RunningModel]


class ShowResponse(TypedDict):
    modelfile: str
    parameters: str                     # the sampling defaults and the loaded context, one "name value" a line
    template: str                       # the chat template
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class Version(TypedDict):
    version: str
    lse_version: str


def details(path: str | None, lse: LSE | None) -> ModelDetails:
    """What Ollama's clients show of a model: its format always, the rest once it is loaded (``lse``)."""
    fmt: Literal["gguf", "safetensors"] = "gguf" if (path or "").lower().endswith(".gguf") else "safetensors"
    if lse is None:
        return ModelDetails(parent_model="", format=fmt, family="", families=None, parameter_size="",
                            quantization_level="")
    weights = lse.model.weights.values()
    count = sum(math.prod(w.shape) for w in weights)
    kinds = Counter(getattr(w, "qtype", None) or str(w.dtype).upper().replace("FLOAT", "F") for w in weights)
    family = lse.model.architecture
    return ModelDetails(parent_model="", format=fmt, family=family, families=[family],
                        parameter_size=_size(count), quantization_level=kinds.most_common(1)[0][0] if kinds else "")


def _size(count: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g}{unit}"
    return str(count)


def _file_facts(path: str | None) -> tuple[int, float]:
    """The bytes and latest modification time of a model's files."""
    files = [path] if path and os.path.isfile(path) else [
        os.path.join(path, n) for n in os.listdir(path)] if path and os.path.isdir(path) else []
    stats = [os.stat(f) for f in files if os.path.isfile(f)]
    return sum(s.st_size for s in stats), max((s.st_mtime for s in stats), default=0.0)


def _timestamp(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


def listed_model(model_id: str, path: str | None, lse: LSE | None) -> ListedModel:
    """One /api/tags entry: ``path`` the model's file or directory (None: the default model's)."""
    size, mtime = _file_facts(path)
    digest = hashlib.sha256(f"{path}\0{size}\0{mtime}".encode()).hexdigest()
    return ListedModel(name=model_id, model=model_id, modified_at=_timestamp(mtime), size=size, digest=digest,
                       details=details(path, lse))


def running_model(listed: ListedModel, lse: LSE, memory_bytes: int, expires_in: float | None) -> RunningModel:
    """One /api/ps entry: ``expires_in`` the seconds until it is unloaded (None: it stays)."""
    expires = FOREVER if expires_in is None else _timestamp(time.time() + expires_in)
    return RunningModel(name=listed["name"], model=listed["model"], size=memory_bytes, digest=listed["digest"],
                        details=listed["details"], expires_at=expires, size_vram=0, context_length=lse.context_length)


def show(listed: ListedModel, path: str | None, lse: LSE) -> ShowResponse:
    """/api/show of a loaded model."""
    defaults = lse.defaults.to_json()
    parameters = [f"{name} {defaults[field]}" for name, field in (
        ("temperature", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"), ("min_p", "min_p"),
        ("repeat_penalty", "repetition_penalty"), ("presence_penalty", "presence_penalty"))]
    parameters.append(f"num_ctx {lse.context_length}")
    arch, config = lse.model.architecture, lse.model.config
    model_info = {"general.architecture": arch, "general.parameter_count": sum(
        math.prod(w.shape) for w in lse.model.weights.values())} | {
        f"{arch}.{name}": config[key] for name, key in (
            ("context_length", "max_position_embeddings"), ("embedding_length", "hidden_size"),
            ("block_count", "num_hidden_layers"), ("attention.head_count", "num_attention_heads"),
            ("attention.head_count_kv", "num_key_value_heads"), ("vocab_size", "vocab_size")) if key in config}
    tools = lse.template is not None and tool_call_format(lse.template.source) is not None
    capabilities = ["completion"] + (["tools"] if tools else []) + (["thinking"] if lse.thinking.supported else [])
    return ShowResponse(modelfile=f"# served by lse-server\nFROM {path or lse.model.source}\n",
                        parameters="\n".join(parameters), template=lse.template.source if lse.template else "",
                        details=listed["details"], model_info=model_info, capabilities=capabilities,
                        modified_at=listed["modified_at"])


def version(lse_version: str) -> Version:
    return Version(version=OLLAMA_VERSION, lse_version=lse_version)
