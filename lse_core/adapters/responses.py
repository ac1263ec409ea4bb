"""OpenAI's Responses API (/v1/responses) over the core's chat request.

``input`` (a string, or messages, function_call and function_call_output items), ``instructions`` and a
stored conversation (``previous_response_id``) become chat messages; the core's chunks become output items
(reasoning, message, function_call) and the typed stream events the openai SDK reads. The response object has
every field the Open Responses specification requires of one (the settings the reply was made with among them),
and LSE's stop_reason, lse_context, timings and lse_warnings beside them.

``POST /v1/responses/compact`` (``compact``) runs the model over the conversation to summarise it: its answer is
the conversation's user messages and a compaction item holding the summary, which a later request passes as
its input in place of the earlier turns."""

from __future__ import annotations

import copy
import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag
from typing_extensions import TypeAliasType, TypedDict  # pydantic reads typing's TypedDict only from Python 3.12

from lse_core import protocol
from lse_core.adapters.common import (
    AS_INTEGER,
    Body,
    CoreDelta,
    CoreEnd,
    Count,
    Part,
    Positive,
    checked,
    pass_through,
    renamed_param,
)
from lse_core.errors import ErrorDetail, LSEError, invalid_request
from lse_core.protocol import Closing, StopReason
from lse_core.sampling import GenerationDefaults, resolve_sampling

STORED_RESPONSES = 256   # conversations kept for previous_response_id; the oldest goes first
# Chat fields as a Responses body names them, for the core's errors. The operator's cap (--max-tokens) keeps
# the name max_tokens, as the spec says of every API.
PARAMS = {"messages": "input", "response_format": "text.format",
          "response_format.json_schema.schema": "text.format.schema",
          "tools[*].function.parameters": "tools[*].parameters"}
# What /v1/responses/compact asks the model, after the conversation: its answer is the compaction item.
COMPACT_INSTRUCTION = ("Summarize the conversation so far, to continue it without the earlier messages: the user's "
                       "goals, the facts found, the decisions made and the open tasks. Write only the summary.")


# ---- the request ----

class TextPart(Part):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(Part):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]


class FunctionCallItem(Part):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Part):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


class ReasoningText(Part):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Part):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None


class CompactionInputItem(Part):
    """A compaction item from /v1/responses/compact: the summary of the turns it replaces."""

    type: Literal["compaction"]
    encrypted_content: str


def _item_type(value: Any) -> str:
    return value.get("type", "message") if isinstance(value, dict) else "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[CompactionInputItem, Tag("compaction")],
    Discriminator(_item_type)]


class FunctionTool(Part):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(Part):
    type: Literal["function"]
    name: str


class Reasoning(Part):
    effort: str | None = None
    summary: str | None = None


class TextFormat(Part):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(Part):
    format: TextFormat | None = None


ServiceTier = Literal["auto", "default", "flex", "priority"]
Key = Annotated[str, Field(max_length=64)]


class ResponsesRequest(Body):
    """A /v1/responses body. LSE's own sampling and thinking fields (top_k, min_p, seed, stop,
    enable_thinking, ...) and presence_penalty, frequency_penalty pass through to the core as chat-completions
    fields."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool | None = None
    max_output_tokens: Positive | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Reasoning | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    max_tool_calls: Positive | None = None      # the reply's function calls past it are left out
    top_logprobs: Annotated[int, Field(ge=0, le=20), AS_INTEGER] | None = None
    background: bool | None = None
    service_tier: ServiceTier | None = None     # LSE has one tier: "default"
    safety_identifier: Key | None = None        # echoed
    prompt_cache_key: Key | None = None         # echoed: LSE's prefix cache needs no key


class CompactRequest(Body):
    """A /v1/responses/compact body: the conversation to compact, as /v1/responses takes one. Other fields pass
    through as they do there (LSE's sampling and thinking fields)."""

    model: str | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    prompt_cache_key: Key | None = None
    stream: bool | None = None


class ResponseStore:
    """Finished responses by id, each with its conversation for previous_response_id: the last
    STORED_RESPONSES."""

    def __init__(self, size: int = STORED_RESPONSES) -> None:
        self.size = size
        self._stored: OrderedDict[str, tuple[list[dict[str, Any]], Response]] = OrderedDict()
        self._lock = threading.Lock()

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """The messages a turn after ``response_id`` continues; 400 previous_response_not_found."""
        with self._lock:
            stored = self._stored.get(response_id)
        if stored is None:
            raise invalid_request(f"previous response {response_id!r:.80} is not stored here: {self._why}",
                                  "previous_response_not_found", "previous_response_id")
        return copy.deepcopy(stored[0])

    def response(self, response_id: str) -> Response:
        """GET /v1/responses/{id}: the response object; 404 response_not_found."""
        with self._lock:
            stored = self._stored.get(response_id)
        if stored is None:
            raise self._not_found(response_id)
        return copy.deepcopy(stored[1])

    def delete(self, response_id: str) -> DeletedResponse:
        """DELETE /v1/responses/{id}: forget it (a later previous_response_id naming it gets 400)."""
        with self._lock:
            stored = self._stored.pop(response_id, None)
        if stored is None:
            raise self._not_found(response_id)
        return DeletedResponse(id=response_id, object="response.deleted", deleted=True)

    def put(self, response_id: str, messages: list[dict[str, Any]], response: Response) -> None:
        with self._lock:
            self._stored[response_id] = messages, copy.deepcopy(response)
            while len(self._stored) > self.size:
                self._stored.popitem(last=False)

    @property
    def _why(self) -> str:
        return f"it was never made with store, was deleted, or is older than the last {self.size} responses"

    def _not_found(self, response_id: str) -> LSEError:
        return LSEError(f"response {response_id!r:.80} is not stored here: {self._why}", status=404,
                        code="response_not_found", param="response_id")


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


def chat_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Input items as chat messages: a function_call joins the assistant turn before it (or opens
    one), a reasoning item goes with the assistant turn after it."""
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning = "\n".join(part.text for part in (item.content or item.summary))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        else:
            if isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if not messages or messages[-1]["role"] != "assistant":
                    messages.append({"role": "assistant", "content": ""})
                messages[-1].setdefault("tool_calls", []).append(call)
            elif isinstance(item, CompactionInputItem):   # the model's own summary of the turns it replaces
                messages.append({"role": "assistant", "content": item.encrypted_content})
            else:
                messages.append({"role": item.role, "content": _text(item.content)})
            if reasoning is not None and messages[-1]["role"] == "assistant":
                messages[-1]["reasoning_content"], reasoning = reasoning, None
    return messages


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def _conversation(req: ResponsesRequest | CompactRequest, store: ResponseStore) -> list[dict[str, Any]]:
    """The stored conversation ``previous_response_id`` names, then ``input``'s items, as chat messages."""
    history = store.conversation(req.previous_response_id) if req.previous_response_id else []
    items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input or []
    return history + chat_messages(items)


def _system(instructions: str | None) -> list[dict[str, Any]]:
    return [{"role": "system", "content": instructions}] if instructions is not None else []


def start(body: Any, store: ResponseStore, model_id: str,
          defaults: GenerationDefaults | None = None) -> tuple[dict[str, Any], ResponsesTranslation]:
    """A /v1/responses body as the chat body to run and the translation of its reply; raises LSEError.
    ``defaults``: the model's sampling defaults, which the response reports where the body sets none."""
    req = checked(ResponsesRequest, body)
    if req.background:
        raise invalid_request("background: LSE runs every response while its request waits; send stream: true to "
                              "read it as it is written", "invalid_value", "background")
    if req.top_logprobs:
        raise invalid_request("top_logprobs: LSE's Responses output carries no logprobs; /v1/chat/completions "
                              "returns them (logprobs, top_logprobs)", "invalid_value", "top_logprobs")
    conversation = _conversation(req, store)
    system = _system(req.instructions)
    tool_choice = req.tool_choice
    chat = {
        "model": req.model, "messages": system + conversation, "max_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p,
        "tools": [{"type": "function", "function": t.model_dump(exclude={"type", "strict"}, exclude_none=True)}
                  for t in req.tools] if req.tools else None,
        "tool_choice": {"type": "function", "function": {"name": tool_choice.name}}
        if isinstance(tool_choice, FunctionChoice) else tool_choice,
        "reasoning": {"effort": req.reasoning.effort} if req.reasoning and req.reasoning.effort else None,
        "response_format": _response_format(req.text), "stop": body.get("stop"),
    } | pass_through(body)
    chat = {k: v for k, v in chat.items() if v is not None}
    return chat, ResponsesTranslation(req, conversation, store, model_id, sampling_used(chat, defaults))


def sampling_used(chat: dict[str, Any], defaults: GenerationDefaults | None) -> SamplingUsed:
    """The sampling the core runs ``chat`` with (its fields, else the model's defaults), as the response reports
    it. The chat body is checked here as the core checks it, so a bad field is refused with the same error."""
    request = protocol.parse_chat(chat)
    sampling = resolve_sampling(request, defaults or GenerationDefaults())
    return SamplingUsed(temperature=sampling.temperature, top_p=sampling.top_p,
                        presence_penalty=sampling.presence_penalty,
                        frequency_penalty=float(request.frequency_penalty or 0.0))


def compact(body: Any, store: ResponseStore) -> tuple[dict[str, Any], CompactTranslation]:
    """A /v1/responses/compact body as the chat body that asks the model for the summary, and the translation
    of its reply into the compacted output; raises LSEError."""
    req = checked(CompactRequest, body)
    if req.stream:
        raise invalid_request("stream: a compaction is answered whole", "invalid_value", "stream")
    conversation = _conversation(req, store)
    if not conversation:
        raise invalid_request("there is no conversation to compact: send input, previous_response_id or both",
                              "missing_field", "input")
    messages = _system(req.instructions) + conversation + [{"role": "user", "content": COMPACT_INSTRUCTION}]
    chat = {k: v for k, v in ({"model": req.model, "messages": messages} | pass_through(body)).items()
            if v is not None}
    kept = [UserMessage(type="message", id=_id("msg"), status="completed", role="user",
                        content=[InputTextPart(type="input_text", text=m["content"])])
            for m in conversation if m["role"] == "user"]
    return chat, CompactTranslation(kept)


def websocket_body(message: str) -> dict[str, Any]:
    """A WebSocket message as the /v1/responses body it asks for, streamed: a JSON ``response.create`` event,
    which does not send ``stream``, ``stream_options`` or ``background`` (every response streams on the socket,
    as the Open Responses document says). Raises LSEError."""
    try:
        event = json.loads(message)
    except (ValueError, RecursionError) as e:
        raise invalid_request(f"the message is not valid JSON: {e}", "invalid_json") from None
    if not isinstance(event, dict):
        raise invalid_request("a message must be a JSON object", "invalid_type")
    if event.get("type") != "response.create":
        raise invalid_request(f"the message's type is {event.get('type')!r:.80}; LSE takes response.create",
                              "invalid_value", "type")
    for field in ("stream", "stream_options", "background"):
        if field in event:
            raise invalid_request(f"{field} is not sent over the WebSocket: every response streams on it",
                                  "invalid_value", field)
    if event.get("generate") is False:
        raise invalid_request("generate: false (preparing a turn without a response) is not supported",
                              "invalid_value", "generate")
    return {k: v for k, v in event.items() if k != "type"} | {"stream": True}


def error_body(body: dict[str, Any], status: int) -> dict[str, Any]:
    """An error in OpenAI's shape, as the core's are, naming the Responses field."""
    return renamed_param(body, PARAMS)


# ---- the reply ----
# Declared once, as the TypedDicts below (lse_core.protocol's convention): the translation builds them and
# /openapi.json takes their schemas. A TypedDict is a plain dict, so a stream event costs no validation.

ResponseStatus = Literal["in_progress", "completed", "incomplete", "cancelled", "failed"]
ItemStatus = Literal["in_progress", "completed"]
Empty = Annotated[list[Any], Field(max_length=0)]    # annotations, logprobs, summaries: LSE makes none


class OutputTextPart(TypedDict):
    type: Literal["output_text"]
    text: str
    annotations: Empty
    logprobs: Empty


class ReasoningTextPart(TypedDict):
    type: Literal["reasoning_text"]
    text: str


class ResponseMessageItem(TypedDict):
    type: Literal["message"]
    id: str
    role: Literal["assistant"]
    status: ItemStatus
    content: list[OutputTextPart]       # its one part, once it is added


class ResponseReasoningItem(TypedDict):
    type: Literal["reasoning"]
    id: str
    summary: Empty
    content: list[ReasoningTextPart]
    status: ItemStatus


class ResponseFunctionCallItem(TypedDict):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str                      # JSON text
    status: ItemStatus


OutputItem = Annotated[ResponseMessageItem | ResponseReasoningItem | ResponseFunctionCallItem,
                       Field(discriminator="type")]
ContentPart = Annotated[OutputTextPart | ReasoningTextPart, Field(discriminator="type")]


class InputTokensDetails(TypedDict):
    cached_tokens: Count


class OutputTokensDetails(TypedDict):
    reasoning_tokens: Count


class ResponseUsage(TypedDict):
    input_tokens: Count                 # the whole prompt, cached tokens included
    input_tokens_details: InputTokensDetails
    output_tokens: Count
    output_tokens_details: OutputTokensDetails
    total_tokens: Count


class IncompleteDetails(TypedDict):
    reason: Literal["max_output_tokens"]


class ResponseReasoning(TypedDict):
    effort: str | None
    summary: None


class ResponseText(TypedDict):
    format: TextFormat                  # the request's text.format ({"type": "text"} without one)


class SamplingUsed(TypedDict):
    """The sampling a reply was made with: the request's fields, else the model's defaults."""

    temperature: float
    top_p: float
    presence_penalty: float
    frequency_penalty: float


class ResponseSnapshot(SamplingUsed):
    """The response as it stands: in progress (usage null) in a stream's first events, finished as a Response.
    The request's settings are echoed back, as OpenAI does: a field typed with a request model holds its JSON."""

    id: str
    object: Literal["response"]
    created_at: int
    completed_at: int | None            # when its status became completed
    status: ResponseStatus
    error: ErrorDetail | None           # a failed response's error (its code never null, as Open Responses asks)
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: ResponseReasoning
    store: bool
    background: Literal[False]
    service_tier: Literal["default"]
    top_logprobs: Literal[0]
    text: ResponseText
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice
    tools: list[FunctionTool]
    truncation: Literal["disabled"]
    metadata: dict[str, str]
    safety_identifier: str | None
    prompt_cache_key: str | None
    usage: ResponseUsage | None


class Response(ResponseSnapshot, Closing):
    """A finished response, with LSE's stop_reason, lse_context, timings and lse_warnings."""

    stop_reason: StopReason


class DeletedResponse(TypedDict):
    id: str
    object: Literal["response.deleted"]
    deleted: Literal[True]


class _Event(TypedDict):
    sequence_number: Count


class ResponseCreatedEvent(_Event):
    type: Literal["response.created"]
    response: ResponseSnapshot


class ResponseInProgressEvent(_Event):
    type: Literal["response.in_progress"]
    response: ResponseSnapshot


class _OutputItemEvent(_Event):
    output_index: Count
    item: OutputItem


class ResponseOutputItemAddedEvent(_OutputItemEvent):
    type: Literal["response.output_item.added"]


class ResponseOutputItemDoneEvent(_OutputItemEvent):
    type: Literal["response.output_item.done"]


class ContentPlace(TypedDict):
    """Where a content event writes: the item's only part."""

    item_id: str
    output_index: Count
    content_index: Literal[0]


class ResponseContentPartAddedEvent(_Event, ContentPlace):
    type: Literal["response.content_part.added"]
    part: ContentPart


class ResponseContentPartDoneEvent(_Event, ContentPlace):
    type: Literal["response.content_part.done"]
    part: ContentPart


class ResponseTextDeltaEvent(_Event, ContentPlace):
    type: Literal["response.output_text.delta"]
    delta: str
    logprobs: Empty


class ResponseTextDoneEvent(_Event, ContentPlace):
    type: Literal["response.output_text.done"]
    text: str
    logprobs: Empty


class ResponseReasoningTextDeltaEvent(_Event, ContentPlace):
    type: Literal["response.reasoning_text.delta"]
    delta: str


class ResponseReasoningTextDoneEvent(_Event, ContentPlace):
    type: Literal["response.reasoning_text.done"]
    text: str


class _FunctionCallEvent(_Event):
    item_id: str
    output_index: Count


class ResponseFunctionCallArgumentsDeltaEvent(_FunctionCallEvent):
    type: Literal["response.function_call_arguments.delta"]
    delta: str                          # the whole arguments: a call comes whole


class ResponseFunctionCallArgumentsDoneEvent(_FunctionCallEvent):
    type: Literal["response.function_call_arguments.done"]
    name: str
    arguments: str


class ResponseCompletedEvent(_Event):
    type: Literal["response.completed"]
    response: Response


class ResponseIncompleteEvent(_Event):
    type: Literal["response.incomplete"]
    response: Response


class ResponseCancelledEvent(_Event):
    type: Literal["response.cancelled"]
    response: Response


class ResponseErrorEvent(_Event):
    """The error of a request that fails once its stream began: the error's fields, as OpenAI sends them, and
    the whole error under ``error``, as Open Responses does. response.failed follows it."""

    type: Literal["error"]
    code: str | None
    message: str
    param: str | None
    error: ErrorDetail


class ResponseFailedEvent(_Event):
    """How a stream ends when its request fails: the response as it stood, its status failed, with the error."""

    type: Literal["response.failed"]
    response: ResponseSnapshot


class WebSocketErrorEvent(TypedDict):
    """A WebSocket message refused before any of its response's events: its HTTP status and the error."""

    type: Literal["error"]
    status: int
    error: ErrorDetail


# a named alias: /openapi.json names it as a component, whose schema is the union
ResponseStreamEvent = TypeAliasType("ResponseStreamEvent", Annotated[
    ResponseCreatedEvent | ResponseInProgressEvent | ResponseOutputItemAddedEvent | ResponseOutputItemDoneEvent
    | ResponseContentPartAddedEvent | ResponseContentPartDoneEvent | ResponseTextDeltaEvent | ResponseTextDoneEvent
    | ResponseReasoningTextDeltaEvent | ResponseReasoningTextDoneEvent | ResponseFunctionCallArgumentsDeltaEvent
    | ResponseFunctionCallArgumentsDoneEvent | ResponseCompletedEvent | ResponseIncompleteEvent
    | ResponseCancelledEvent | ResponseErrorEvent | ResponseFailedEvent, Field(discriminator="type")])

# a response's status once finished, by the core's stop_reason (any other: incomplete), and its last event
ENDED: dict[str, ResponseStatus] = {"stop_token": "completed", "stop_sequence": "completed", "cancelled": "cancelled"}
ENDING_EVENTS = {"completed": ResponseCompletedEvent, "incomplete": ResponseIncompleteEvent,
                 "cancelled": ResponseCancelledEvent}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesTranslation:
    """The core's deltas as output items and stream events; the whole response at the end."""

    def __init__(self, req: ResponsesRequest, conversation: list[dict[str, Any]], store: ResponseStore,
                 model_id: str, sampling: SamplingUsed) -> None:
        self.req = req
        self.sampling = sampling
        self.stream = bool(req.stream)
        self.conversation = conversation
        self.store = store
        self.id = _id("resp")
        self.created = int(time.time())
        self.model = req.model or model_id
        self.output: list[OutputItem] = []
        self.open: ResponseMessageItem | ResponseReasoningItem | None = None    # the item being written
        self.sequence = 0
        self.started = False

    def _next(self) -> int:
        """The next event's sequence_number."""
        self.sequence += 1
        return self.sequence - 1

    def feed(self, delta: CoreDelta, prompt_tokens: int = 0) -> list[ResponseStreamEvent]:
        events: list[ResponseStreamEvent] = []
        if not self.started:
            self.started = True
            snapshot = copy.deepcopy(self._snapshot("in_progress"))    # its output is written on after it
            events += [ResponseCreatedEvent(type="response.created", sequence_number=self._next(), response=snapshot),
                       ResponseInProgressEvent(type="response.in_progress", sequence_number=self._next(),
                                               response=snapshot)]
        if delta.reasoning:
            events += self._write("reasoning", delta.reasoning)
        if delta.content:
            events += self._write("message", delta.content)
        for call in delta.tool_calls:
            if self.req.max_tool_calls is not None and self._calls() == self.req.max_tool_calls:
                break
            events += self._close()
            events += self._function_call(call)
        return events

    def _calls(self) -> int:
        return sum(item["type"] == "function_call" for item in self.output)

    def _write(self, kind: Literal["message", "reasoning"], text: str) -> list[ResponseStreamEvent]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            events += self._open(kind)
        assert self.open is not None
        self.open["content"][0]["text"] += text
        where = self._where(self.open)
        if kind == "message":
            events.append(ResponseTextDeltaEvent(type="response.output_text.delta", sequence_number=self._next(),
                                                 **where, delta=text, logprobs=[]))
        else:
            events.append(ResponseReasoningTextDeltaEvent(type="response.reasoning_text.delta",
                                                          sequence_number=self._next(), **where, delta=text))
        return events

    def _where(self, item: OutputItem) -> ContentPlace:
        return ContentPlace(item_id=item["id"], output_index=self.output.index(item), content_index=0)

    def _open(self, kind: Literal["message", "reasoning"]) -> list[ResponseStreamEvent]:
        item: ResponseMessageItem | ResponseReasoningItem
        if kind == "message":
            item = ResponseMessageItem(type="message", id=_id("msg"), role="assistant", status="in_progress",
                                       content=[])
            part: ContentPart = OutputTextPart(type="output_text", text="", annotations=[], logprobs=[])
        else:
            item = ResponseReasoningItem(type="reasoning", id=_id("rs"), summary=[], content=[], status="in_progress")
            part = ReasoningTextPart(type="reasoning_text", text="")
        self.output.append(item)
        self.open = item
        # copies: the item and its part are written on after these events
        events: list[ResponseStreamEvent] = [ResponseOutputItemAddedEvent(
            type="response.output_item.added", sequence_number=self._next(), output_index=len(self.output) - 1,
            item=copy.deepcopy(item))]
        item["content"].append(part)
        return events + [ResponseContentPartAddedEvent(type="response.content_part.added",
                                                       sequence_number=self._next(), **self._where(item),
                                                       part=copy.deepcopy(part))]

    def _close(self) -> list[ResponseStreamEvent]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = "completed"
        part, where = item["content"][0], self._where(item)
        done: ResponseStreamEvent
        if item["type"] == "message":
            done = ResponseTextDoneEvent(type="response.output_text.done", sequence_number=self._next(), **where,
                                         text=part["text"], logprobs=[])
        else:
            done = ResponseReasoningTextDoneEvent(type="response.reasoning_text.done", sequence_number=self._next(),
                                                  **where, text=part["text"])
        return [done, ResponseContentPartDoneEvent(type="response.content_part.done", sequence_number=self._next(),
                                                   **where, part=part),
                ResponseOutputItemDoneEvent(type="response.output_item.done", sequence_number=self._next(),
                                            output_index=where["output_index"], item=item)]

    def _function_call(self, call: dict[str, Any]) -> list[ResponseStreamEvent]:
        function = call["function"]
        item = ResponseFunctionCallItem(type="function_call", id=_id("fc"), call_id=call["id"],
                                        name=function["name"], arguments="", status="in_progress")
        self.output.append(item)
        index = len(self.output) - 1
        events: list[ResponseStreamEvent] = [ResponseOutputItemAddedEvent(
            type="response.output_item.added", sequence_number=self._next(), output_index=index,
            item=copy.deepcopy(item))]    # a copy: the call is completed after it
        item |= {"arguments": function["arguments"], "status": "completed"}
        return events + [
            ResponseFunctionCallArgumentsDeltaEvent(type="response.function_call_arguments.delta",
                                                    sequence_number=self._next(), item_id=item["id"],
                                                    output_index=index, delta=function["arguments"]),
            ResponseFunctionCallArgumentsDoneEvent(type="response.function_call_arguments.done",
                                                   sequence_number=self._next(), item_id=item["id"],
                                                   output_index=index, name=item["name"],
                                                   arguments=function["arguments"]),
            ResponseOutputItemDoneEvent(type="response.output_item.done", sequence_number=self._next(),
                                        output_index=index, item=item)]

    def finish(self, end: CoreEnd) -> tuple[list[ResponseStreamEvent], Response]:
        events = self._close()
        status = ENDED.get(end.stop_reason, "incomplete")
        response = Response(**self._snapshot(status, _usage(end)), stop_reason=end.stop_reason, **end.lse)
        if self.req.store is not False and status != "cancelled":
            self.store.put(self.id, self.conversation + [self._assistant_turn()], response)
        last = ENDING_EVENTS[status](type=f"response.{status}", sequence_number=self._next(), response=response)
        return events + [last], response

    def _assistant_turn(self) -> dict[str, Any]:
        """The reply as the chat message a later turn's template renders."""
        turn: dict[str, Any] = {"role": "assistant", "content": ""}
        for item in self.output:
            if item["type"] == "message":
                turn["content"] += item["content"][0]["text"]
            elif item["type"] == "reasoning":
                turn["reasoning_content"] = item["content"][0]["text"]
            else:
                turn.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                    "name": item["name"], "arguments": item["arguments"]}})
        return turn

    def _snapshot(self, status: ResponseStatus, usage: ResponseUsage | None = None,
                  error: dict[str, Any] | None = None) -> ResponseSnapshot:
        """The response object with OpenAI's fields: in progress (no usage yet), finished, or failed (``error``)."""
        req = self.req
        return ResponseSnapshot(
            id=self.id, object="response", created_at=self.created,
            completed_at=int(time.time()) if status == "completed" else None, status=status, error=error,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            max_tool_calls=req.max_tool_calls, model=self.model,
            output=self.output, parallel_tool_calls=req.parallel_tool_calls is not False,
            previous_response_id=req.previous_response_id,
            reasoning=ResponseReasoning(effort=req.reasoning.effort if req.reasoning else None, summary=None),
            store=req.store is not False, background=False, service_tier="default", top_logprobs=0,
            **self.sampling, text=ResponseText(format=_format_echo(req.text)),
            tool_choice=req.tool_choice.model_dump() if isinstance(req.tool_choice, FunctionChoice)
            else req.tool_choice or "auto",
            tools=[t.model_dump() for t in req.tools or []], truncation="disabled",
            metadata=req.metadata or {}, safety_identifier=req.safety_identifier,
            prompt_cache_key=req.prompt_cache_key, usage=usage)

    def stream_error(self, body: dict[str, Any], status: int) -> list[ResponseStreamEvent]:
        """The events that end a stream whose request failed: the error, then response.failed, as Open Responses
        says every error in a stream is followed."""
        error = stream_error_event(body, status, self._next())
        failed = self._snapshot("failed", error=error["error"] | {"code": error["code"] or error["error"]["type"]})
        return [error, ResponseFailedEvent(type="response.failed", sequence_number=self._next(), response=failed)]


def _usage(end: CoreEnd) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=end.prompt_tokens, input_tokens_details=InputTokensDetails(cached_tokens=end.cached_tokens),
        output_tokens=end.completion_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=end.reasoning_tokens),
        total_tokens=end.prompt_tokens + end.completion_tokens)


def _format_echo(text: TextConfig | None) -> dict[str, Any]:
    """The request's text.format as a response reports it: a json_schema format with each of its fields."""
    fmt = text.format if text else None
    if fmt is None:
        return {"type": "text"}
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    return fmt.model_dump(by_alias=True) | {"strict": bool(fmt.strict)}


def stream_error_event(body: dict[str, Any], status: int, sequence_number: int) -> ResponseErrorEvent:
    """The ``error`` event a stream ends with when its request fails after ``sequence_number`` events."""
    error = error_body(body, status)["error"]
    return ResponseErrorEvent(type="error", sequence_number=sequence_number, code=error["code"],
                              message=error["message"], param=error["param"], error=error)


def websocket_error_event(body: dict[str, Any], status: int) -> WebSocketErrorEvent:
    """The ``error`` message that answers a WebSocket ``response.create`` refused before its stream began."""
    return WebSocketErrorEvent(type="error", status=status, error=error_body(body, status)["error"])


# ---- /v1/responses/compact's answer ----

class InputTextPart(TypedDict):
    type: Literal["input_text"]
    text: str


class UserMessage(TypedDict):
    """A user message of the compacted conversation, kept as it was."""

    type: Literal["message"]
    id: str
    status: Literal["completed"]
    role: Literal["user"]
    content: list[InputTextPart]


class CompactionItem(TypedDict):
    """The summary of the compacted turns. OpenAI encrypts it; LSE keeps the model's summary as plain text."""

    type: Literal["compaction"]
    id: str
    encrypted_content: str


class Compaction(Closing):
    """/v1/responses/compact's answer: ``output`` is the next request's input in place of the conversation."""

    id: str
    object: Literal["response.compaction"]
    created_at: int
    output: list[Annotated[UserMessage | CompactionItem, Field(discriminator="type")]]
    usage: ResponseUsage
    stop_reason: StopReason


class CompactTranslation:
    """The summary's reply as the compacted output: the conversation's user messages, then the summary."""

    stream = False

    def __init__(self, kept: list[UserMessage]) -> None:
        self.kept = kept
        self.started = False
        self.summary: list[str] = []

    def feed(self, delta: CoreDelta, prompt_tokens: int = 0) -> list[ResponseStreamEvent]:
        self.started = True
        self.summary.append(delta.content)     # a thinking model's reasoning is not part of the summary
        return []

    def finish(self, end: CoreEnd) -> tuple[list[ResponseStreamEvent], Compaction]:
        summary = CompactionItem(type="compaction", id=_id("cmp"), encrypted_content="".join(self.summary).strip())
        return [], Compaction(id=_id("resp"), object="response.compaction", created_at=int(time.time()),
                              output=[*self.kept, summary], usage=_usage(end), stop_reason=end.stop_reason, **end.lse)

    def stream_error(self, body: dict[str, Any], status: int) -> ResponseErrorEvent:
        return stream_error_event(body, status, 0)
