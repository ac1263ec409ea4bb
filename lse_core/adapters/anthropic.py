"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) over the core's chat request.

``system`` and ``messages`` (text, tool_use, tool_result and thinking blocks) become chat messages,
``thinking`` the core's own spelling of the switch (so the template's levels decide, as on every endpoint),
and the core's chunks become content blocks (thinking, text, tool_use) and Anthropic's stream events.
LSE's stop_reason travels as lse_stop_reason beside Anthropic's, with lse_context, timings and lse_warnings.
Errors are Anthropic's {"type": "error", "error": {"type", "message"}}, with LSE's code and param too."""

from __future__ import annotations

import copy
import json
import uuid
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, NotRequired

from pydantic import Field
from typing_extensions import TypeAliasType, TypedDict  # pydantic reads typing's TypedDict only from Python 3.12

from lse_core.adapters.common import (
    Body,
    CoreDelta,
    CoreEnd,
    Count,
    Integer,
    Part,
    Positive,
    Text,
    checked,
    pass_through,
    renamed_param,
)
from lse_core.limits import LSEContext
from lse_core.protocol import Closing, StopReason

# Chat fields as a Messages body names them, for the core's errors.
PARAMS = {"stop": "stop_sequences", "stop[": "stop_sequences[", "reasoning_effort": "output_config.effort",
          "response_format": "output_config.format", "thinking_budget": "thinking.budget_tokens",
          "response_format.json_schema.schema": "output_config.format.schema",
          "tools[*].function.parameters": "tools[*].input_schema"}
MessageStopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"]
STOP_REASONS: dict[str, MessageStopReason | None] = {
    "stop_token": "end_turn", "stop_sequence": "stop_sequence", "max_tokens": "max_tokens",
    "context_full": "model_context_window_exceeded", "cancelled": None}
ErrorType = Literal["invalid_request_error", "authentication_error", "permission_error", "not_found_error",
                    "request_too_large", "rate_limit_error", "overloaded_error", "api_error"]
ERROR_TYPES: dict[int, ErrorType] = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}   # any other: api_error


# ---- the request ----

class TextBlock(Part):
    type: Literal["text"]
    text: str


class ToolUseBlock(Part):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(Part):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None


class ThinkingBlock(Part):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Part):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                  Field(discriminator="type")]


class MessageParam(Part):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolParam(Part):
    type: Literal["custom"] | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoiceParam(Part):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(Part):
    type: Literal["enabled", "disabled", "adaptive"]     # adaptive: as the template thinks when it is on
    budget_tokens: Positive | None = None


class OutputFormat(Part):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Part):
    effort: str | None = None            # one of the template's levels, as reasoning_effort is
    format: OutputFormat | None = None


class CountTokensRequest(Body):
    """A /v1/messages/count_tokens body: the conversation, without the reply's settings."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    """A /v1/messages body. temperature, top_k and top_p are those of Anthropic's earlier API versions;
    LSE's own sampling and thinking fields (min_p, seed, ...) pass through to the core as chat fields."""

    max_tokens: Positive
    stop_sequences: list[Text] | None = None
    temperature: float | None = None
    top_k: Integer | None = None
    top_p: float | None = None
    stream: bool | None = None
    metadata: dict[str, Any] | None = None


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "\n".join(block.text for block in content)


def chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """The system prompt and messages as chat messages: a user turn's tool results become tool messages
    (before its text), an assistant turn's thinking its reasoning_content and its tool_use its tool_calls."""
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _text(req.system)})
    for message in req.messages:
        blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) else message.content
        texts = [b.text for b in blocks if isinstance(b, TextBlock)]
        if message.role == "user":
            messages += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)}
                         for b in blocks if isinstance(b, ToolResultBlock)]
            if texts or not messages or messages[-1]["role"] != "tool":
                messages.append({"role": "user", "content": "\n".join(texts)})
            continue
        turn: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
        thinking = [b.thinking for b in blocks if isinstance(b, ThinkingBlock)]
        if thinking:
            turn["reasoning_content"] = "\n".join(thinking)
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in blocks if isinstance(b, ToolUseBlock)]
        if calls:
            turn["tool_calls"] = calls
        messages.append(turn)
    return messages


def _tool_choice(choice: ToolChoiceParam | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def conversation_body(req: CountTokensRequest, body: dict[str, Any]) -> dict[str, Any]:
    """The chat body of a conversation: what count_tokens tokenizes and a message request runs."""
    chat = {
        "model": req.model, "messages": chat_messages(req),
        "tools": [{"type": "function", "function": t.model_dump(include={"name", "description"}, exclude_none=True)
                   | {"parameters": t.input_schema}} for t in req.tools] if req.tools else None,
        "tool_choice": _tool_choice(req.tool_choice),
        "thinking": {"type": "disabled" if req.thinking.type == "disabled" else "enabled"} if req.thinking else None,
    } | pass_through(body)
    if req.thinking is not None and req.thinking.type == "enabled" and req.thinking.budget_tokens is not None:
        chat["thinking_budget"] = req.thinking.budget_tokens     # the core closes the reasoning there
    config = req.output_config
    if config is not None and config.effort is not None:
        chat["reasoning_effort"] = config.effort
    if config is not None and config.format is not None:
        schema = {"name": "output", "schema": config.format.schema_}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    return {k: v for k, v in chat.items() if v is not None}


def count_tokens_body(body: Any) -> dict[str, Any]:
    """A count_tokens body as the chat body whose prompt is counted; raises LSEError."""
    return conversation_body(checked(CountTokensRequest, body), body)


def start(body: Any, model_id: str) -> tuple[dict[str, Any], MessagesTranslation]:
    """A /v1/messages body as the chat body to run and the translation of its reply; raises LSEError."""
    req = checked(MessagesRequest, body)
    sampling = {"max_tokens": req.max_tokens, "stop": req.stop_sequences, "temperature": req.temperature,
                "top_k": req.top_k, "top_p": req.top_p}
    chat = conversation_body(req, body) | {k: v for k, v in sampling.items() if v is not None}
    return chat, MessagesTranslation(req, model_id)


def error_body(body: dict[str, Any], status: int) -> AnthropicError:
    """An LSEError body in Anthropic's shape, its type from the HTTP status; LSE's code, param and extra
    fields (levels, lse_context) are kept."""
    error = {k: v for k, v in renamed_param(body, PARAMS)["error"].items() if k != "type"}
    return AnthropicError(type="error", error=AnthropicErrorDetail(type=ERROR_TYPES.get(status, "api_error"), **error))


def model_list(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """/v1/models as Anthropic's clients read it (they send anthropic-version): each entry's ModelInfo
    fields, with LSE's context_length, thinking and generation_defaults beside them."""
    data = [{"type": "model", "id": e["id"], "display_name": e["id"],
             "created_at": datetime.fromtimestamp(e["created"], UTC).isoformat().replace("+00:00", "Z")}
            | {k: e[k] for k in ("context_length", "thinking", "generation_defaults")} for e in entries]
    return {"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}


# ---- the reply ----
# Declared once, as the TypedDicts below (lse_core.protocol's convention): the translation builds them and
# /openapi.json takes their schemas. A TypedDict is a plain dict, so a stream event costs no validation.

class TextContentBlock(TypedDict):
    type: Literal["text"]
    text: str


class ThinkingContentBlock(TypedDict):
    type: Literal["thinking"]
    thinking: str
    signature: str                      # always empty: LSE signs nothing


class ToolUseContentBlock(TypedDict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]               # the call's arguments


ContentBlock = Annotated[TextContentBlock | ThinkingContentBlock | ToolUseContentBlock, Field(discriminator="type")]


class AnthropicUsage(TypedDict):
    input_tokens: Count                 # the prompt's uncached tokens
    output_tokens: Count
    cache_read_input_tokens: NotRequired[Count]       # the finished message's
    cache_creation_input_tokens: NotRequired[Count]


class MessageSnapshot(TypedDict):
    """The message with Anthropic's fields: empty in message_start, finished as a Message."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlock]
    stop_reason: MessageStopReason | None       # None: not finished, or cancelled
    stop_sequence: str | None
    usage: AnthropicUsage


class Message(MessageSnapshot, Closing):
    """A finished message, with LSE's stop_reason (as lse_stop_reason), lse_context, timings and lse_warnings."""

    lse_stop_reason: StopReason


class MessageStartEvent(TypedDict):
    type: Literal["message_start"]
    message: MessageSnapshot


class PingEvent(TypedDict):
    type: Literal["ping"]


class ContentBlockStartEvent(TypedDict):
    type: Literal["content_block_start"]
    index: Count
    content_block: ContentBlock


class TextDelta(TypedDict):
    type: Literal["text_delta"]
    text: str


class ThinkingDelta(TypedDict):
    type: Literal["thinking_delta"]
    thinking: str


class InputJSONDelta(TypedDict):
    type: Literal["input_json_delta"]
    partial_json: str                   # the whole arguments: a call comes whole


class ContentBlockDeltaEvent(TypedDict):
    type: Literal["content_block_delta"]
    index: Count
    delta: Annotated[TextDelta | ThinkingDelta | InputJSONDelta, Field(discriminator="type")]


class ContentBlockStopEvent(TypedDict):
    type: Literal["content_block_stop"]
    index: Count


class MessageDelta(TypedDict):
    stop_reason: MessageStopReason | None
    stop_sequence: str | None


class MessageDeltaEvent(Closing):
    """The message's ending, with the finished Message's usage and LSE's fields."""

    type: Literal["message_delta"]
    delta: MessageDelta
    usage: AnthropicUsage
    lse_stop_reason: StopReason


class MessageStopEvent(TypedDict):
    type: Literal["message_stop"]


class AnthropicErrorDetail(TypedDict):
    """An LSE error's fields (lse_core.errors.ErrorDetail), its type one of Anthropic's."""

    type: ErrorType
    message: str
    code: str | None
    param: str | None
    levels: NotRequired[list[str]]
    lse_context: NotRequired[LSEContext]
    models: NotRequired[list[str]]


class AnthropicError(TypedDict):
    """Anthropic's error body, also the error event that ends a stream whose request fails after it began."""

    type: Literal["error"]
    error: AnthropicErrorDetail


# a named alias: /openapi.json names it as a component, whose schema is the union
MessageStreamEvent = TypeAliasType("MessageStreamEvent", Annotated[
    MessageStartEvent | PingEvent | ContentBlockStartEvent | ContentBlockDeltaEvent | ContentBlockStopEvent
    | MessageDeltaEvent | MessageStopEvent | AnthropicError, Field(discriminator="type")])


class MessagesTranslation:
    """The core's deltas as content blocks and stream events; the whole message at the end."""

    def __init__(self, req: MessagesRequest, model_id: str) -> None:
        self.req = req
        self.stream = bool(req.stream)
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = req.model or model_id
        self.content: list[ContentBlock] = []
        self.open: TextContentBlock | ThinkingContentBlock | None = None    # the block being written
        self.started = False

    def feed(self, delta: CoreDelta, prompt_tokens: int = 0) -> list[MessageStreamEvent]:
        events: list[MessageStreamEvent] = []
        if not self.started:
            self.started = True
            start = self._message([], None, AnthropicUsage(input_tokens=prompt_tokens, output_tokens=0))
            events += [MessageStartEvent(type="message_start", message=start), PingEvent(type="ping")]
        if delta.reasoning:
            events += self._write("thinking", delta.reasoning)
        if delta.content:
            events += self._write("text", delta.content)
        for call in delta.tool_calls:
            events += self._close()
            function = call["function"]
            block = ToolUseContentBlock(type="tool_use", id=call["id"], name=function["name"], input={})
            events += self._start_block(block)
            block["input"] = json.loads(function["arguments"])
            index = len(self.content) - 1
            events += [ContentBlockDeltaEvent(type="content_block_delta", index=index, delta=InputJSONDelta(
                           type="input_json_delta", partial_json=function["arguments"])),
                       ContentBlockStopEvent(type="content_block_stop", index=index)]
        return events

    def _start_block(self, block: ContentBlock) -> list[MessageStreamEvent]:
        self.content.append(block)
        return [ContentBlockStartEvent(type="content_block_start", index=len(self.content) - 1,
                                       content_block=copy.deepcopy(block))]   # a copy: the block is written on

    def _write(self, kind: Literal["thinking", "text"], text: str) -> list[MessageStreamEvent]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            self.open = ThinkingContentBlock(type="thinking", thinking="", signature="") if kind == "thinking" \
                else TextContentBlock(type="text", text="")
            events += self._start_block(self.open)
        delta: TextDelta | ThinkingDelta
        if self.open["type"] == "thinking":
            self.open["thinking"] += text
            delta = ThinkingDelta(type="thinking_delta", thinking=text)
        else:
            self.open["text"] += text
            delta = TextDelta(type="text_delta", text=text)
        return events + [ContentBlockDeltaEvent(type="content_block_delta", index=len(self.content) - 1,
                                                delta=delta)]

    def _close(self) -> list[MessageStreamEvent]:
        if self.open is None:
            return []
        self.open = None
        return [ContentBlockStopEvent(type="content_block_stop", index=len(self.content) - 1)]

    def finish(self, end: CoreEnd) -> tuple[list[MessageStreamEvent], Message]:
        events = self._close()
        stop_reason = STOP_REASONS[end.stop_reason]
        if stop_reason == "end_turn" and any(block["type"] == "tool_use" for block in self.content):
            stop_reason = "tool_use"
        stop_sequence = end.stop_string if stop_reason == "stop_sequence" else None
        usage = AnthropicUsage(input_tokens=end.prompt_tokens - end.cached_tokens,
                               output_tokens=end.completion_tokens, cache_read_input_tokens=end.cached_tokens,
                               cache_creation_input_tokens=0)
        message = Message(**self._message(self.content, stop_reason, usage, stop_sequence),
                          lse_stop_reason=end.stop_reason, **end.lse)
        events += [MessageDeltaEvent(type="message_delta", delta=MessageDelta(stop_reason=stop_reason,
                                                                              stop_sequence=stop_sequence),
                                     usage=usage, lse_stop_reason=end.stop_reason, **end.lse),
                   MessageStopEvent(type="message_stop")]
        return events, message

    def _message(self, content: list[ContentBlock], stop_reason: MessageStopReason | None, usage: AnthropicUsage,
                 stop_sequence: str | None = None) -> MessageSnapshot:
        return MessageSnapshot(id=self.id, type="message", role="assistant", model=self.model,
                               content=copy.deepcopy(content), stop_reason=stop_reason, stop_sequence=stop_sequence,
                               usage=usage)

    def stream_error(self, body: dict[str, Any], status: int) -> AnthropicError:
        return error_body(body, status)
