"""OpenAI's Responses API (/v1/responses) over the core's chat request.

``input`` (a string, or messages, function_call and function_call_output items), ``instructions`` and a
stored conversation (``previous_response_id``) become chat messages; the core's chunks become output items
(reasoning, message, function_call) and the typed stream events the openai SDK reads. The final response
carries LSE's stop_reason, lse_context, timings and lse_warnings beside OpenAI's fields."""

from __future__ import annotations

import copy
import threading
import time
import uuid
from collections import OrderedDict
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from lse_core.adapters.common import (
    Body,
    CoreDelta,
    CoreEnd,
    Part,
    Positive,
    checked,
    pass_through,
    renamed_param,
)
from lse_core.errors import LSEError, invalid_request

STORED_RESPONSES = 256   # conversations kept for previous_response_id; the oldest goes first
# Chat fields as a Responses body names them, for the core's errors.
PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


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


def _item_type(value: Any) -> str:
    return value.get("type", "message") if isinstance(value, dict) else "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
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


class ResponsesRequest(Body):
    """A /v1/responses body. LSE's own sampling and thinking fields (top_k, min_p, seed, stop,
    enable_thinking, ...) pass through to the core as chat-completions fields."""

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


class ResponseStore:
    """Finished responses by id, each with its conversation for previous_response_id: the last
    STORED_RESPONSES."""

    def __init__(self, size: int = STORED_RESPONSES) -> None:
        self.size = size
        self._stored: OrderedDict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """The messages a turn after ``response_id`` continues; 400 previous_response_not_found."""
        with self._lock:
            stored = self._stored.get(response_id)
        if stored is None:
            raise invalid_request(f"previous response {response_id!r:.80} is not stored here: {self._why}",
                                  "previous_response_not_found", "previous_response_id")
        return copy.deepcopy(stored[0])

    def response(self, response_id: str) -> dict[str, Any]:
        """GET /v1/responses/{id}: the response object; 404 response_not_found."""
        with self._lock:
            stored = self._stored.get(response_id)
        if stored is None:
            raise self._not_found(response_id)
        return copy.deepcopy(stored[1])

    def delete(self, response_id: str) -> dict[str, Any]:
        """DELETE /v1/responses/{id}: forget it (a later previous_response_id naming it gets 400)."""
        with self._lock:
            stored = self._stored.pop(response_id, None)
        if stored is None:
            raise self._not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def put(self, response_id: str, messages: list[dict[str, Any]], response: dict[str, Any]) -> None:
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


def start(body: Any, store: ResponseStore, model_id: str) -> tuple[dict[str, Any], ResponsesTranslation]:
    """A /v1/responses body as the chat body to run and the translation of its reply; raises LSEError."""
    req = checked(ResponsesRequest, body)
    history = store.conversation(req.previous_response_id) if req.previous_response_id else []
    items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    conversation = history + chat_messages(items)
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
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
    return chat, ResponsesTranslation(req, conversation, store, model_id)


def error_body(body: dict[str, Any], status: int) -> dict[str, Any]:
    """An error in OpenAI's shape, as the core's are, naming the Responses field."""
    return renamed_param(body, PARAMS)


# ---- the reply ----

def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesTranslation:
    """The core's deltas as output items and stream events; the whole response at the end."""

    def __init__(self, req: ResponsesRequest, conversation: list[dict[str, Any]], store: ResponseStore,
                 model_id: str) -> None:
        self.req = req
        self.stream = bool(req.stream)
        self.conversation = conversation
        self.store = store
        self.id = _id("resp")
        self.created = int(time.time())
        self.model = req.model or model_id
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None    # the reasoning or message item being written
        self.sequence = 0
        self.started = False

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **copy.deepcopy(fields)}

    def feed(self, delta: CoreDelta, prompt_tokens: int = 0) -> list[dict[str, Any]]:
        events = []
        if not self.started:
            self.started = True
            snapshot = self.response("in_progress")
            events += [self._event("response.created", response=snapshot),
                       self._event("response.in_progress", response=snapshot)]
        if delta.reasoning:
            events += self._write("reasoning", delta.reasoning)
        if delta.content:
            events += self._write("message", delta.content)
        for call in delta.tool_calls:
            events += self._close()
            events += self._function_call(call)
        return events

    def _write(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            events += self._open(kind)
        assert self.open is not None
        self.open["content"][0]["text"] += text
        where = self._where(self.open)
        if kind == "message":
            events.append(self._event("response.output_text.delta", **where, delta=text, logprobs=[]))
        else:
            events.append(self._event("response.reasoning_text.delta", **where, delta=text))
        return events

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.output.index(item), "content_index": 0}

    def _open(self, kind: str) -> list[dict[str, Any]]:
        if kind == "message":
            item = {"type": "message", "id": _id("msg"), "role": "assistant", "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        self.output.append(item)
        self.open = item
        events = [self._event("response.output_item.added", output_index=len(self.output) - 1, item=item)]
        item["content"].append(part)
        return events + [self._event("response.content_part.added", **self._where(item), part=part)]

    def _close(self) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = "completed"
        part, where = item["content"][0], self._where(item)
        if item["type"] == "message":
            done = self._event("response.output_text.done", **where, text=part["text"], logprobs=[])
        else:
            done = self._event("response.reasoning_text.done", **where, text=part["text"])
        return [done, self._event("response.content_part.done", **where, part=part),
                self._event("response.output_item.done", output_index=where["output_index"], item=item)]

    def _function_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        function = call["function"]
        item = {"type": "function_call", "id": _id("fc"), "call_id": call["id"], "name": function["name"],
                "arguments": "", "status": "in_progress"}
        self.output.append(item)
        index = len(self.output) - 1
        events = [self._event("response.output_item.added", output_index=index, item=item)]
        item |= {"arguments": function["arguments"], "status": "completed"}
        where = {"item_id": item["id"], "output_index": index}
        return events + [
            self._event("response.function_call_arguments.delta", **where, delta=function["arguments"]),
            self._event("response.function_call_arguments.done", **where, name=item["name"],
                        arguments=function["arguments"]),
            self._event("response.output_item.done", output_index=index, item=item)]

    def finish(self, end: CoreEnd) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        events = self._close()
        status = {"stop_token": "completed", "stop_sequence": "completed", "cancelled": "cancelled"}.get(
            end.stop_reason, "incomplete")
        response = self.response(status, end)
        if self.req.store is not False and status != "cancelled":
            self.store.put(self.id, self.conversation + [self._assistant_turn()], response)
        kind = "response.completed" if status == "completed" else f"response.{status}"
        return events + [self._event(kind, response=response)], response

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

    def response(self, status: str, end: CoreEnd | None = None) -> dict[str, Any]:
        """The response object: in progress (no usage yet), or finished with LSE's fields."""
        req = self.req
        body: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.model,
            "output": self.output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": req.store is not False, "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)
                     if req.text and req.text.format else {"type": "text"}},
            "tool_choice": req.tool_choice.model_dump() if isinstance(req.tool_choice, FunctionChoice)
            else req.tool_choice or "auto",
            "tools": [t.model_dump() for t in req.tools or []], "truncation": "disabled",
            "metadata": req.metadata or {}, "usage": None,
        }
        if end is not None:
            body["usage"] = {"input_tokens": end.prompt_tokens, "input_tokens_details": {
                "cached_tokens": end.cached_tokens}, "output_tokens": end.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": end.reasoning_tokens},
                "total_tokens": end.prompt_tokens + end.completion_tokens}
            body |= {"stop_reason": end.stop_reason} | end.lse
        return body

    def stream_error(self, body: dict[str, Any], status: int) -> dict[str, Any]:
        self.sequence += 1
        return stream_error_event(body, status, self.sequence - 1)


def stream_error_event(body: dict[str, Any], status: int, sequence_number: int) -> dict[str, Any]:
    """The ``error`` event a stream ends with when its request fails after ``sequence_number`` events."""
    error = error_body(body, status)["error"]
    return {"type": "error", "sequence_number": sequence_number, "code": error["code"], "message": error["message"],
            "param": error["param"]}
