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

The bodies are lse_core.adapters.openai's pydantic models, which follow OpenAI: unknown fields are
ignored, null means not sent. Every type or range error is a 400 invalid_request_error whose code is
missing_field, invalid_type or invalid_value and whose param is the field's path ("messages[2].content",
"stop[1]"). The rules across fields are here: one choice per request (n > 1, best_of > 1 and several
prompts in one request are refused), at most one output constraint, top_logprobs only with logprobs.
"""

from __future__ import annotations

import codecs
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, NotRequired

from pydantic import ConfigDict, Field, TypeAdapter, WithJsonSchema, computed_field
from pydantic.dataclasses import dataclass as pydantic_dataclass
from typing_extensions import TypedDict  # pydantic reads typing's TypedDict only from Python 3.12

from lse_core.adapters.common import REPLY_PART, Count, checked
from lse_core.adapters.openai import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    GenerationBody,
    ResponseFormat,
    StructuredOutputs,
    TokenizeBody,
    TokenizeText,
)
from lse_core.errors import invalid_request
from lse_core.limits import LSEContext, lse_context
from lse_core.sampling import GenerationDefaults

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
    speculative: bool = True                        # False: the server's speculative decoding stays off for it
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


JSON_OBJECT = {"type": "object"}
# vLLM's structured_outputs fields and the constraint kind each asks for
STRUCTURED_OUTPUT_KINDS = {"json_": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark"}


def parse_chat(body: object) -> GenerationRequest:
    """A /v1/chat/completions body, checked; raises LSEError (400) naming the offending field."""
    return chat_request(checked(ChatCompletionRequest, body), body)


def parse_completion(body: object) -> GenerationRequest:
    """A /v1/completions body, checked; raises LSEError (400) naming the offending field."""
    return completion_request(checked(CompletionRequest, body), body)


def chat_request(checked_body: ChatCompletionRequest, body: Any) -> GenerationRequest:
    request = _generation_request(checked_body, body, "chat")
    if checked_body.top_logprobs and not checked_body.logprobs:
        raise invalid_request("top_logprobs needs logprobs: true", "invalid_value", "top_logprobs")
    # the template gets tools, tool_choice and earlier calls as the client sent them, checked
    request.messages = [_message(m, sent) for m, sent in zip(checked_body.messages, body["messages"], strict=True)]
    request.logprobs, request.top_logprobs = bool(checked_body.logprobs), checked_body.top_logprobs or 0
    request.tools = None if checked_body.tools is None else body["tools"]
    request.tool_choice = None if checked_body.tool_choice is None else body["tool_choice"]
    request.parallel_tool_calls = checked_body.parallel_tool_calls is not False
    request.chat_template_kwargs = checked_body.chat_template_kwargs
    return request


def completion_request(checked_body: CompletionRequest, body: Any) -> GenerationRequest:
    request = _generation_request(checked_body, body, "completion")
    if checked_body.suffix:
        raise invalid_request("suffix is not supported: LSE completes after the prompt only", "invalid_value",
                              "suffix")
    _one_choice(checked_body.best_of, "best_of")
    prompt = checked_body.prompt
    if isinstance(prompt, list) and isinstance(prompt[0], str | list):   # a batch: one prompt only
        if len(prompt) > 1:
            raise invalid_request("several prompts in one request are not supported; send one per request",
                                  "invalid_value", "prompt")
        prompt = prompt[0]
    request.prompt = prompt
    request.logprobs, request.top_logprobs = checked_body.logprobs is not None, checked_body.logprobs or 0
    request.echo = bool(checked_body.echo)
    return request


def _generation_request(checked_body: GenerationBody, body: dict[str, Any], endpoint: str) -> GenerationRequest:
    _one_choice(checked_body.n, "n")
    if checked_body.logit_bias:
        raise invalid_request("logit_bias is not supported", "invalid_value", "logit_bias")
    max_tokens = checked_body.max_tokens
    stop = checked_body.stop
    return GenerationRequest(
        endpoint=endpoint,
        body=body,
        model=checked_body.model,
        stream=bool(checked_body.stream),
        include_usage=bool(checked_body.stream_options and checked_body.stream_options.include_usage),
        stop=() if stop is None else (stop,) if isinstance(stop, str) else tuple(stop),
        max_tokens=checked_body.max_completion_tokens if max_tokens is None else max_tokens,
        temperature=checked_body.temperature,
        top_k=checked_body.top_k,
        top_p=checked_body.top_p,
        min_p=checked_body.min_p,
        presence_penalty=checked_body.presence_penalty,
        repetition_penalty=checked_body.repetition_penalty,
        frequency_penalty=checked_body.frequency_penalty,
        seed=checked_body.seed,
        ignore_eos=bool(checked_body.ignore_eos),
        speculative=checked_body.speculative is not False,
        constraint=_output_constraint(checked_body),
    )


def _one_choice(count: int | None, param: str) -> None:
    """OpenAI's n and best_of: LSE answers one choice; ignoring more would answer something else."""
    if count is not None and count > 1:
        raise invalid_request(f"{param} must be 1: LSE returns one choice per request; send {param} requests "
                              "instead", "invalid_value", param)


# ---- messages ----

def _message(message: ChatMessage, sent: dict[str, Any]) -> dict[str, Any]:
    """One message, normalized for templates: content a string; an assistant's tool_calls and
    reasoning_content, a tool message's tool_call_id and any name kept."""
    content = message.content
    text = content if isinstance(content, str) else "\n".join(part.text for part in content or [])
    normalized: dict[str, Any] = {"role": message.role, "content": text}
    kept = {"name": message.name}
    if message.role == "assistant":
        kept |= {"tool_calls": message.tool_calls and [_call(call) for call in sent["tool_calls"]],
                 "reasoning_content": message.reasoning_content}
    if message.role == "tool":
        kept["tool_call_id"] = message.tool_call_id
    return normalized | {name: value for name, value in kept.items() if value is not None}


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


def _call(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant's earlier call as sent, with JSON-object arguments as CallArguments."""
    function = call["function"]
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            return call | {"function": function | {"arguments": CallArguments(arguments, parsed)}}
    return call


# ---- structured output ----

def _output_constraint(checked_body: GenerationBody) -> OutputConstraint | None:
    """The reply's constraint: response_format (json_object, json_schema), vLLM's structured_outputs (json,
    regex, choice, grammar), or llama.cpp's grammar (GBNF) and json_schema; at most one of them."""
    found = [c for c in (
        _response_format(checked_body.response_format),
        _structured_outputs(checked_body.structured_outputs),
        None if checked_body.grammar is None else OutputConstraint("gbnf", checked_body.grammar, "grammar"),
        None if checked_body.json_schema is None else OutputConstraint("json_schema", checked_body.json_schema,
                                                                        "json_schema"),
    ) if c is not None]
    if len(found) > 1:
        first, second = (c.param.split(".")[0] for c in found[:2])
        raise invalid_request(f"{second} and {first} both constrain the reply; send one", "invalid_value", second)
    return found[0] if found else None


def _response_format(value: ResponseFormat | None) -> OutputConstraint | None:
    if value is None or value.type == "text":
        return None
    if value.type == "json_object":
        return OutputConstraint("json_schema", JSON_OBJECT, "response_format")
    spec = value.json_schema
    return OutputConstraint("json_schema", JSON_OBJECT if spec.schema_ is None else spec.schema_,
                            "response_format.json_schema.schema", bool(spec.strict))


def _structured_outputs(value: StructuredOutputs | None) -> OutputConstraint | None:
    if value is None:
        return None
    if value.json_object is not None:
        return OutputConstraint("json_schema", JSON_OBJECT, "structured_outputs.json_object") \
            if value.json_object else None
    name, kind = next((name, kind) for name, kind in STRUCTURED_OUTPUT_KINDS.items()
                      if getattr(value, name) is not None)
    return OutputConstraint(kind, getattr(value, name), f"structured_outputs.{name.rstrip('_')}")


# ---- the tokenizer endpoints ----

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
    tokenize = checked(TokenizeBody, body).root
    request, content = None, ""
    if isinstance(tokenize, TokenizeText):
        content = tokenize.content
    elif isinstance(tokenize, ChatCompletionRequest):
        request = chat_request(tokenize, body)
    else:
        request = completion_request(tokenize, body)
    add_special = tokenize.add_special_tokens if tokenize.add_special is None else tokenize.add_special
    return TokenizeRequest(request, content, add_special, tokenize.add_generation_prompt is not False,
                           bool(tokenize.with_pieces))


def parse_detokenize(body: object, vocab_size: int) -> list[int]:
    """A /detokenize body's token ids, each in the vocabulary."""
    tokens = checked(DetokenizeRequest, body).tokens
    bad = next((i for i, token in enumerate(tokens) if token >= vocab_size), None)
    if bad is not None:
        raise invalid_request(f"tokens[{bad}] must be a token id from 0 to {vocab_size - 1}", "invalid_value",
                              f"tokens[{bad}]")
    return tokens


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


# Usage, Timings and LSEWarning are pydantic dataclasses: /openapi.json takes their schemas from them
# (their serialized shape, computed fields included), so each reply part is declared once.


@pydantic_dataclass(frozen=True)
class PromptTokensDetails:
    cached_tokens: Count


@pydantic_dataclass(frozen=True)
class CompletionTokensDetails:
    reasoning_tokens: Count


@pydantic_dataclass(config=REPLY_PART)
class Usage:
    prompt_tokens: Count       # the whole prompt, cached tokens included
    completion_tokens: Count
    cached_tokens: Count = Field(0, exclude=True)
    reasoning_tokens: Count = Field(0, exclude=True)

    @computed_field
    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @computed_field
    @property
    def prompt_tokens_details(self) -> PromptTokensDetails:
        return PromptTokensDetails(self.cached_tokens)

    @computed_field(description="of the completion tokens, those written inside the reasoning block")
    @property
    def completion_tokens_details(self) -> CompletionTokensDetails:
        return CompletionTokensDetails(self.reasoning_tokens)

    def to_json(self) -> dict[str, Any]:
        return _USAGE.dump_python(self)


_DRAFT_COUNTERS = ("draft_n", "draft_n_accepted")


def _drafts_optional(schema: dict[str, Any]) -> None:
    """Timings' draft counters are sent only when the reply had proposals, as llama-server sends them."""
    schema["required"] = [name for name in schema.get("required", []) if name not in _DRAFT_COUNTERS]


@pydantic_dataclass(config=ConfigDict(**REPLY_PART, json_schema_extra=_drafts_optional))
class Timings:
    prompt_n: Count            # prompt tokens computed (cached ones are not)
    prompt_ms: float
    predicted_n: Count
    predicted_ms: float
    # speculative decoding, when it proposed tokens (llama-server's names): tokens proposed, and those kept
    draft_n: Count | None = None
    draft_n_accepted: Count | None = None

    @computed_field
    @property
    def prompt_per_second(self) -> float:
        return _per_second(self.prompt_n, self.prompt_ms)

    @computed_field
    @property
    def predicted_per_second(self) -> float:
        return _per_second(self.predicted_n, self.predicted_ms)

    def to_json(self) -> dict[str, Any]:
        return _TIMINGS.dump_python(self, exclude_none=True)


@pydantic_dataclass
class LSEWarning:
    """One lse_warnings entry: a CPU fallback cause and how often this request ran it, or (count None,
    left out of the JSON) another warning about the reply, such as structured output cut short or an Ollama
    option ignored."""

    cause: str
    count: Count | None = Field(None, description="a cpu_fallback's runs in this request")
    type: Literal["cpu_fallback", "structured_output_incomplete", "ignored_option"] = "cpu_fallback"

    def to_json(self) -> dict[str, Any]:
        return _WARNING.dump_python(self, exclude_none=True)


_USAGE, _TIMINGS, _WARNING = TypeAdapter(Usage), TypeAdapter(Timings), TypeAdapter(LSEWarning)


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
# Each reply is declared once, as the TypedDicts below: Reply builds them, and /openapi.json takes their schemas.
# A TypedDict is a plain dict, so a streamed chunk costs no validation; a field typed with a pydantic reply part
# (Usage, Timings, LSEContext, LSEWarning) holds that part's JSON (its to_json()).

StopReason = Literal["stop_token", "stop_sequence", "max_tokens", "context_full", "cancelled"]
FinishReason = Literal["stop", "length", "tool_calls"] | None
One = Field(min_length=1, max_length=1)      # a reply's choices: LSE answers one


class FunctionCall(TypedDict):
    name: str
    arguments: str          # JSON text


class ToolCall(TypedDict):
    """One entry of OpenAI's message.tool_calls."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class ToolCallDelta(ToolCall):
    index: Count            # its place among the reply's calls


class TopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(TypedDict):
    content: list[ChatTokenLogprob]
    refusal: None


class TextLogprobs(TypedDict):
    tokens: list[str]
    token_logprobs: list[float | None]      # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float]]
    text_offset: list[Count]


class ReplyMessage(TypedDict):
    role: Literal["assistant"]
    content: str | None                      # None: only tool calls
    reasoning_content: NotRequired[str]
    tool_calls: NotRequired[list[ToolCall]]


class ChatDelta(TypedDict, total=False):
    role: Literal["assistant"]               # the first chunk's
    content: str
    reasoning_content: str
    tool_calls: list[ToolCallDelta]


class ChatChoice(TypedDict):
    index: Literal[0]
    message: ReplyMessage
    finish_reason: FinishReason
    stop_reason: StopReason
    logprobs: ChatLogprobs | None


class ChatChunkChoice(TypedDict):
    index: Literal[0]
    delta: ChatDelta
    finish_reason: FinishReason
    stop_reason: StopReason | None           # None until the final chunk
    logprobs: ChatLogprobs | None


class TextChoice(TypedDict):
    index: Literal[0]
    text: str
    reasoning_content: NotRequired[str]
    finish_reason: FinishReason
    stop_reason: StopReason
    logprobs: TextLogprobs | None


class TextChunkChoice(TypedDict):
    index: Literal[0]
    text: str
    reasoning_content: NotRequired[str]
    finish_reason: FinishReason
    stop_reason: StopReason | None
    logprobs: TextLogprobs | None


class Closing(TypedDict):
    """What a whole reply and a stream's final chunk carry."""

    lse_context: LSEContext
    timings: Timings
    lse_warnings: NotRequired[list[LSEWarning]]


class ReplyEnvelope(TypedDict):
    id: str
    created: int
    model: str


class ChatCompletion(ReplyEnvelope, Closing):
    object: Literal["chat.completion"]
    choices: Annotated[list[ChatChoice], One]
    usage: Usage


class TextCompletion(ReplyEnvelope, Closing):
    object: Literal["text_completion"]
    choices: Annotated[list[TextChoice], One]
    usage: Usage


class ChunkEnvelope(ReplyEnvelope):
    """A streamed chunk: a delta (stop_reason null), the final chunk (finish and stop_reason, and Closing's
    fields) or, with stream_options.include_usage, the usage chunk (choices empty; usage null on the others)."""

    usage: NotRequired[Usage | None]
    lse_context: NotRequired[LSEContext]
    timings: NotRequired[Timings]
    lse_warnings: NotRequired[list[LSEWarning]]


class ChatCompletionChunk(ChunkEnvelope):
    object: Literal["chat.completion.chunk"]
    choices: Annotated[list[ChatChunkChoice], Field(max_length=1)]


class TextCompletionChunk(ChunkEnvelope):
    object: Literal["text_completion"]
    choices: Annotated[list[TextChunkChoice], Field(max_length=1)]


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

    def response(self, outcome: Outcome) -> ChatCompletion | TextCompletion:
        """A chat.completion or text_completion object."""
        choice = outcome.choice
        ending = {"finish_reason": finish_reason(choice), "stop_reason": choice.stop_reason,
                  "logprobs": self._logprobs(choice.logprobs or [], TextOffsets())}
        whole = {**self._envelope(), "usage": outcome.usage.to_json(), **self._closing(outcome)}
        if self.chat:
            message = ReplyMessage(role="assistant",
                                   content=None if choice.tool_calls and not choice.text else choice.text)
            if choice.reasoning is not None:
                message["reasoning_content"] = choice.reasoning
            if choice.tool_calls:
                message["tool_calls"] = choice.tool_calls
            return ChatCompletion(**whole, object="chat.completion",
                                  choices=[ChatChoice(index=0, message=message, **ending)])
        text = TextChoice(index=0, text=choice.text, **ending)
        if choice.reasoning is not None:
            text["reasoning_content"] = choice.reasoning
        return TextCompletion(**whole, object="text_completion", choices=[text])

    def chunk(self, text: str = "", reasoning: str = "", logprobs: list[TokenLogprob] | None = None,
              tool_calls: list[ToolCall] | None = None) -> ChatCompletionChunk | TextCompletionChunk:
        """One streamed delta. The first chat chunk carries the role; tool calls come whole, in one chunk."""
        ending = {"logprobs": self._logprobs(logprobs or [], self._stream_offsets), "finish_reason": None,
                  "stop_reason": None}
        if not self.chat:
            shaped = TextChunkChoice(index=0, text=text, **ending)
            if reasoning:
                shaped["reasoning_content"] = reasoning
            return self._chunk([shaped])
        delta = ChatDelta()
        if not self._role_sent:
            delta["role"] = "assistant"
        if text or not self._role_sent:
            delta["content"] = text
        if reasoning:
            delta["reasoning_content"] = reasoning
        if tool_calls:
            delta["tool_calls"] = [ToolCallDelta(index=i, **call) for i, call in enumerate(tool_calls)]
        self._role_sent = True
        return self._chunk([ChatChunkChoice(index=0, delta=delta, **ending)])

    def final_chunks(self, outcome: Outcome) -> list[ChatCompletionChunk | TextCompletionChunk]:
        """The end of a stream: the chunk with finish_reason, stop_reason, lse_context, timings and
        lse_warnings, then the usage chunk when stream_options.include_usage (preceded by the role
        chunk when no delta was sent)."""
        chunks = [] if self._role_sent or not self.chat else [self.chunk()]
        choice = outcome.choice
        ending = {"logprobs": None, "finish_reason": finish_reason(choice), "stop_reason": choice.stop_reason}
        shaped = ChatChunkChoice(index=0, delta=ChatDelta(), **ending) if self.chat else \
            TextChunkChoice(index=0, text="", **ending)
        chunks.append(self._chunk([shaped]) | self._closing(outcome))
        if self.request.include_usage:
            chunks.append(self._chunk([]) | {"usage": outcome.usage.to_json()})
        return chunks

    def _envelope(self) -> ReplyEnvelope:
        return ReplyEnvelope(id=self.id, created=self.created, model=self.model)

    def _chunk(self, choices: list[ChatChunkChoice] | list[TextChunkChoice]
               ) -> ChatCompletionChunk | TextCompletionChunk:
        chunk = ChatCompletionChunk(**self._envelope(), object="chat.completion.chunk", choices=choices) \
            if self.chat else TextCompletionChunk(**self._envelope(), object="text_completion", choices=choices)
        if self.request.include_usage:   # as OpenAI: usage null on every chunk but the usage chunk
            chunk["usage"] = None
        return chunk

    def _closing(self, outcome: Outcome) -> Closing:
        used = outcome.usage.prompt_tokens + outcome.usage.completion_tokens
        closing = Closing(lse_context=lse_context(used, outcome.context_length), timings=outcome.timings.to_json())
        if outcome.warnings:
            closing["lse_warnings"] = [w.to_json() for w in outcome.warnings]
        return closing

    def _logprobs(self, tokens: list[TokenLogprob], offsets: TextOffsets) -> ChatLogprobs | TextLogprobs | None:
        """OpenAI's logprobs object for these tokens; null when the request asked for none."""
        if not self.request.logprobs:
            return None
        if self.chat:
            return ChatLogprobs(content=[ChatTokenLogprob(**_top_logprob(t.token, t.logprob), top_logprobs=[
                _top_logprob(token, logprob) for token, logprob in t.top]) for t in tokens], refusal=None)
        return TextLogprobs(tokens=[token_text(t.token) for t in tokens], token_logprobs=[t.logprob for t in tokens],
                            top_logprobs=[{token_text(token): logprob for token, logprob in t.top} for t in tokens],
                            text_offset=offsets.of(tokens))


def _top_logprob(token: bytes, logprob: float) -> TopLogprob:
    return TopLogprob(token=token_text(token), logprob=logprob, bytes=list(token))


@pydantic_dataclass(frozen=True)
class TokenPiece:
    id: Count
    piece: str | list[Count]   # its text, or its byte values when it is no UTF-8 by itself


@pydantic_dataclass(config=REPLY_PART)
class Tokenized:
    """/tokenize's answer: llama.cpp's tokens (ids, or with pieces {id, piece}) and vLLM's count and max_model_len."""

    tokens: list[Count | TokenPiece]
    count: Count
    max_model_len: Count


@pydantic_dataclass(config=REPLY_PART)
class Content:
    """/detokenize's answer, as llama.cpp's."""

    content: str


_TOKENIZED, _CONTENT = TypeAdapter(Tokenized), TypeAdapter(Content)


def tokenized(ids: list[int], pieces: list[bytes] | None, context_length: int) -> dict[str, Any]:
    tokens: list[int | TokenPiece] = list(ids)
    if pieces is not None:
        tokens = [TokenPiece(i, text if (text := _utf8(p)) is not None else list(p)) for i, p in zip(ids, pieces)]
    return _TOKENIZED.dump_python(Tokenized(tokens, len(ids), context_length))


def detokenized(text: str) -> dict[str, Any]:
    return _CONTENT.dump_python(Content(text))


def _nullable_ref(name: str) -> Any:
    """A JSON value whose schema is /openapi.json's component ``name`` (a reply part of its own), or null (inside
    anyOf: pydantic would look a bare $ref up among its own definitions)."""
    return WithJsonSchema({"anyOf": [{"$ref": f"#/components/schemas/{name}"}, {"type": "null"}]})


@pydantic_dataclass(frozen=True)
class StructuredOutputsSupport:
    """What lse_core.structured.supported() says of structured output."""

    supported: bool
    engine: str
    kinds: list[str]
    fields: list[str]
    tool_choice: list[str]


ModelState = Literal["loaded", "loading", "unloaded", "failed"]


@pydantic_dataclass(kw_only=True)
class Model:
    """One /v1/models entry. state and reason are the model set's, in /v1/models only (not model_info's served)."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    context_length: Count | None
    thinking: Annotated[dict[str, Any] | None, _nullable_ref("Thinking")]
    generation_defaults: Annotated[dict[str, Any] | None, _nullable_ref("GenerationDefaults")]
    structured_outputs: StructuredOutputsSupport
    state: ModelState = None      # None: left out, as in model_info's served
    reason: str | None = None


_MODEL = TypeAdapter(Model)
_STATE = {"state", "reason"}


def model_entry(model_id: str, created: int, context_length: int | None, thinking: dict[str, Any] | None,
                defaults: GenerationDefaults | None, structured_outputs: dict[str, Any]) -> dict[str, Any]:
    """The model's entry without its state; ``thinking`` is the template's thinking object as the spec shows it,
    ``structured_outputs`` what lse_core.structured supports. None: not known before the model first loads."""
    model = Model(id=model_id, object="model", created=created, owned_by="lse", context_length=context_length,
                  thinking=thinking, generation_defaults=defaults.to_json() if defaults is not None else None,
                  structured_outputs=structured_outputs)
    return _MODEL.dump_python(model, exclude=_STATE)


def model_entry_with_state(entry: dict[str, Any], state: str, reason: str | None) -> dict[str, Any]:
    """``entry`` (a model_entry) as /v1/models lists it, with the model's state and why it failed (or null)."""
    return _MODEL.dump_python(Model(**entry, state=state, reason=reason))


@pydantic_dataclass(config=REPLY_PART)
class ModelList:
    """OpenAI's /v1/models."""

    object: Literal["list"]
    data: list[Model]


_MODEL_LIST = TypeAdapter(ModelList)


def model_list(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's /v1/models of these entries: model_entry_with_state dicts, or model_entry dicts (no state)."""
    stateless = any("state" not in e for e in entries)
    return _MODEL_LIST.dump_python(ModelList("list", [Model(**e) for e in entries]),
                                   exclude={"data": {"__all__": _STATE}} if stateless else None)


@pydantic_dataclass(config=REPLY_PART)
class TokenCount:
    """/v1/messages/count_tokens' answer, as Anthropic's."""

    input_tokens: Count


@pydantic_dataclass(config=REPLY_PART)
class Health:
    status: Literal["ok", "loading"]


_TOKEN_COUNT, _HEALTH = TypeAdapter(TokenCount), TypeAdapter(Health)


def token_count(tokens: int) -> dict[str, Any]:
    return _TOKEN_COUNT.dump_python(TokenCount(tokens))


def health_body(loading: bool) -> dict[str, Any]:
    return _HEALTH.dump_python(Health("loading" if loading else "ok"))
