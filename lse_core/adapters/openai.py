"""OpenAI's request bodies as the core reads them: /v1/chat/completions, /v1/completions, /tokenize and
/detokenize, each a pydantic model that checks it (lse_core.protocol builds the core's request from it)
and that /openapi.json describes it with.

Unknown fields are ignored and null means not sent, as OpenAI's API does. The thinking fields are
declared for the document only (SkipValidation): lse_core.template.thinking checks them, with the spec's
invalid_thinking code. The rules within one object are validators here (only an assistant turn may leave
out content; structured_outputs takes one kind); those across a body's fields (at most one output
constraint, n over 1, top_logprobs without logprobs...) are lse_core.protocol's plain checks."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Discriminator,
    Field,
    Json,
    RootModel,
    SkipValidation,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from lse_core.adapters.common import AS_INTEGER, Body, Part, TokenId

INT64_MAX = 2**63 - 1   # integer fields hold 64-bit values, as OpenAI's do
MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = {"chat": 20, "completion": 5}


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:   # JSON's "\ud800" escapes decode to lone surrogates no tokenizer takes
        raise PydanticCustomError("string_unicode", "not valid Unicode: it holds a lone surrogate") from None
    return text


def _infinite_if_huge(value: Any) -> Any:
    """An integer beyond any float as the infinity it rounds to, so it is refused as not finite."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            float(value)
        except OverflowError:
            return math.inf if value > 0 else -math.inf
    return value


def integer(minimum: int, maximum: int = INT64_MAX) -> Any:
    """An integer field from minimum to maximum (2.0 is the integer 2, as JSON Schema counts it)."""
    return Annotated[int, Field(ge=minimum, le=maximum), AS_INTEGER]


String = Annotated[str, AfterValidator(_valid_unicode)]
Words = Annotated[str, Field(min_length=1), AfterValidator(_valid_unicode)]
Grammar = Annotated[str, Field(pattern=r"\S", description="a grammar's or a regex's text, not blank"),
                    AfterValidator(_valid_unicode)]
Number = Annotated[float, Field(allow_inf_nan=False), BeforeValidator(_infinite_if_huge)]
Fraction = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False), BeforeValidator(_infinite_if_huge)]
Positive64 = integer(1)
Schema = dict[str, Any] | bool   # a JSON Schema: an object, or true (any value) or false (none)


# ---- messages ----

class ChatTextPart(Part):
    type: Literal["text"]
    text: String


class ChatFunctionCall(Part):
    name: String   # the arguments go to the template as sent: it decides what it takes


class ChatToolCall(Part):
    """An earlier call of an assistant turn; the template gets it as sent (id, type and any other field)."""

    function: ChatFunctionCall


class ChatMessage(Part):
    """One message. Only an assistant turn may leave content out (it may hold only tool calls); tool_calls
    and reasoning_content are read on assistant turns, tool_call_id on tool ones."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: String | list[ChatTextPart] | None = Field(None, validate_default=True,
                                                         description="null only on an assistant turn")
    name: String | None = None
    tool_calls: list[ChatToolCall] | None = None
    reasoning_content: String | None = None
    tool_call_id: String | None = None

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, content: Any, info: ValidationInfo) -> Any:
        if content is None and info.data.get("role", "assistant") != "assistant":
            raise PydanticCustomError("missing", "Field required")
        return content


# ---- tools ----

class ChatFunction(Part):
    name: String
    parameters: dict[str, Any] | None = None


class ChatTool(Part):
    """An offered tool; the template gets it as sent (description and any other field)."""

    type: Literal["function"]
    function: ChatFunction


class FunctionName(Part):
    name: String


class ChatToolChoice(Part):
    type: Literal["function"] | None = None
    function: FunctionName


# ---- structured output ----

class JsonSchemaFormat(Part):
    name: String | None = None
    schema_: Schema | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Part):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = Field(None, validate_default=True,
                                                 description="required when type is json_schema")

    @field_validator("json_schema")
    @classmethod
    def _needed_for_json_schema(cls, spec: Any, info: ValidationInfo) -> Any:
        if spec is None and info.data.get("type") == "json_schema":
            raise PydanticCustomError("missing", "Field required")
        return spec


class StructuredOutputs(Part):
    """vLLM's: exactly one of json (a schema, or its JSON text), regex, choice, grammar (Lark), json_object."""

    json_: Schema | Json[Schema] | None = Field(None, alias="json")
    regex: Grammar | None = None
    choice: Annotated[list[String], Field(min_length=1)] | None = None
    grammar: Grammar | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [name for name in self.model_fields_set if getattr(self, name) is not None]
        if len(given) != 1:
            fields = ", ".join(field.alias or name for name, field in type(self).model_fields.items())
            named = ", ".join(type(self).model_fields[name].alias or name for name in given) or "none"
            raise PydanticCustomError("exactly_one", "takes exactly one of {fields}, got {named}",
                                      {"fields": fields, "named": named})
        return self


# ---- thinking (checked by lse_core.template.thinking) ----

class ThinkingSwitch(Part):
    type: Literal["enabled", "disabled"]


class ReasoningEffort(Part):
    effort: str | None = None


# ---- the bodies ----

class StreamOptions(Part):
    include_usage: bool | None = None


class GenerationBody(Body):
    """What chat completions and completions share: sampling (spec/API.md), limits, stop strings,
    thinking and structured output. At most one of response_format, structured_outputs, grammar and
    json_schema constrains the reply."""

    model: String | None = Field(None, description="one of the served models (GET /v1/models), by id; the first "
                                                   "listed when not sent")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: Positive64 | None = None
    max_completion_tokens: Positive64 | None = None
    stop: Words | Annotated[list[Words], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: Positive64 | None = Field(None, description="LSE returns one choice: more than 1 is refused")
    temperature: Number | None = Field(None, description="0 or less is greedy")
    top_k: integer(-1) | None = Field(None, description="0 or -1 turns it off")
    top_p: Fraction | None = None
    min_p: Fraction | None = None
    presence_penalty: Number | None = None
    repetition_penalty: Annotated[float, Field(gt=0, allow_inf_nan=False),
                                  BeforeValidator(_infinite_if_huge)] | None = None
    frequency_penalty: Number | None = None
    seed: integer(0) | None = None
    ignore_eos: bool | None = Field(None, description="end-of-turn tokens do not end the reply")
    speculative: bool | None = Field(None, description="false: no speculative decoding for this request")
    logit_bias: dict[str, Any] | None = Field(None, description="not supported: only an empty one is accepted")
    reasoning_effort: SkipValidation[str | None] = None
    thinking_level: SkipValidation[str | None] = None
    reasoning: SkipValidation[ReasoningEffort | None] = None
    enable_thinking: SkipValidation[bool | None] = None
    thinking: SkipValidation[bool | ThinkingSwitch | None] = None
    chat_template_kwargs: SkipValidation[dict[str, Any] | None] = None
    thinking_budget: SkipValidation[Annotated[int, Field(ge=1)] | None] = Field(
        None, description="reply tokens of reasoning before LSE closes the block")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    grammar: Grammar | None = Field(None, description="llama.cpp's GBNF")
    json_schema: Schema | None = Field(None, description="llama.cpp's: the reply's JSON Schema")


class ChatCompletionRequest(GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: integer(0, MAX_TOP_LOGPROBS["chat"]) | None = Field(None, description="needs logprobs: true")
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChatToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None   # the template's variables: checked here, not skipped


TokenIds = Annotated[list[Annotated[TokenId, Field(le=INT64_MAX)]], Field(min_length=1)]


def _prompt_form(value: Any) -> str:
    """A list whose first item is a prompt is a batch; a list of anything else, token ids."""
    if not isinstance(value, list):
        return "text"
    return "batch" if value and isinstance(value[0], str | list) else "ids"


class CompletionRequest(GenerationBody):
    prompt: Annotated[Annotated[Words, Tag("text")] | Annotated[TokenIds, Tag("ids")]
                      | Annotated[list[Words | TokenIds], Field(min_length=1), Tag("batch")],
                      Discriminator(_prompt_form)] = Field(
        description="text or token ids, or a batch of one of them (several prompts are refused)")
    logprobs: integer(0, MAX_TOP_LOGPROBS["completion"]) | None = Field(
        None, description="the alternatives to give per token")
    echo: bool | None = None
    suffix: String | None = Field(None, description="not supported: only an empty one is accepted")
    best_of: Positive64 | None = Field(None, description="LSE returns one choice: more than 1 is refused")


# ---- the tokenizer endpoints ----

class TokenizeOptions(Body):
    add_special: bool | None = Field(None, description="llama.cpp's: the tokenizer adds its special tokens")
    add_special_tokens: bool | None = Field(None, description="vLLM's name for add_special")
    add_generation_prompt: bool | None = None
    with_pieces: bool | None = None


class TokenizeText(TokenizeOptions):
    """llama.cpp's: plain text."""

    content: String
    prompt: None = None
    messages: None = None


class TokenizeCompletion(CompletionRequest, TokenizeOptions):
    """The prompt that completion would start from."""

    messages: None = None


class TokenizeChat(ChatCompletionRequest, TokenizeOptions):
    """The prompt that chat would start from, rendered by the model's template."""


def _tokenize_form(value: Any) -> str:
    if isinstance(value, dict) and value.get("messages") is not None:
        return "tokenize-chat"
    return "tokenize-completion" if isinstance(value, dict) and value.get("prompt") is not None else "tokenize-text"


class TokenizeBody(RootModel[Annotated[
        Annotated[TokenizeText, Tag("tokenize-text")] | Annotated[TokenizeCompletion, Tag("tokenize-completion")]
        | Annotated[TokenizeChat, Tag("tokenize-chat")], Discriminator(_tokenize_form)]]):
    """A /tokenize body: a chat's (messages), else a completion's (prompt), else llama.cpp's content."""


class DetokenizeRequest(Body):
    tokens: list[TokenId]
