"""Tool calls in a reply: the format comes from the chat template's text, the calls from a streaming parser.

A template shows its model how to call (in its instructions, and in how it renders earlier calls). A call
block starts at a marker and ends at another, or runs to the end of the reply:

  <tool_call>...</tool_call>               Hermes, Qwen, Granite 4, SmolLM3, GLM, Qwen3-Coder, Nemotron
  [TOOL_CALLS]...                          Mistral
  <|tool_call|>...                         Granite 3
  <|tool_call_start|>...<|tool_call_end|>  LFM2
  <tool_calls>...</tool_calls>             Apriel
  <|START_ACTION|>...<|END_ACTION|>        Command R
  <｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>  DeepSeek V3 and R1
  <|tool_calls_section_begin|>...          Kimi K2
  <|tool_calls|>...<|calls|>               Solar Open
  {...}                                    Llama 3.1/3.2: the whole reply is the call (after <|python_tag|>)

Inside a block the calls are JSON (an object or a list; the arguments under "arguments" or "parameters",
as an object or a JSON string), Qwen3-Coder's XML (<function=name><parameter=key>value</parameter>...),
GLM's (name<arg_key>key</arg_key><arg_value>value</arg_value>...), Python calls ([name(key=value)]), or
a name and JSON arguments between the tokens of DeepSeek, Kimi and Solar.
The parser is fed the reply's content deltas: text outside call blocks passes through, text inside is held
back, and so is whatever could still become a marker. A block that does not parse into calls is given back
as content, markers and all, so nothing the model wrote is lost.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from lse_core.protocol import parse_chat


@dataclass(frozen=True)
class ToolCallFormat:
    """open_marker starts a call block; close_marker ends it, or None when the block runs to the reply's end.
    whole_reply: the block is the reply itself, open_marker its first character (kept in the block), after
    whitespace and an optional ``lead`` marker. short_ids: the template checks for Mistral's 9-character ids.

    How LSE writes a call when it enforces one (lse_core.structured): ``body`` is "object" (a block holds one
    JSON object, blocks follow each other on new lines), "list" (a block holds a JSON list of them), "xml"
    (Qwen3-Coder's <function=name> blocks) or None (the calls are written between tokens, which LSE cannot
    enforce); each JSON object holds the function's name under ``name_key``, its arguments under
    ``arguments_key``."""

    open_marker: str
    close_marker: str | None
    whole_reply: bool = False
    lead: str = ""
    short_ids: bool = False
    body: str | None = "list"
    name_key: str = "name"
    arguments_key: str = "arguments"


HERMES = ToolCallFormat("<tool_call>", "</tool_call>", body="object")
HERMES_XML = ToolCallFormat("<tool_call>", "</tool_call>", body="xml")   # Qwen3-Coder, Nemotron 3, Step
MISTRAL = ToolCallFormat("[TOOL_CALLS]", None, short_ids=True)
GRANITE = ToolCallFormat("<|tool_call|>", None)
LFM2 = ToolCallFormat("<|tool_call_start|>", "<|tool_call_end|>")
APRIEL = ToolCallFormat("<tool_calls>", "</tool_calls>")
COMMAND_R = ToolCallFormat("<|START_ACTION|>", "<|END_ACTION|>", name_key="tool_name", arguments_key="parameters")
DEEPSEEK = ToolCallFormat("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", body=None)
KIMI = ToolCallFormat("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", body=None)
SOLAR = ToolCallFormat("<|tool_calls|>", "<|calls|>", body=None)
LLAMA3 = ToolCallFormat("{", None, whole_reply=True, lead="<|python_tag|>", body="object", arguments_key="parameters")
# For a template that shows no call format, when the request enforces a call: the reply is the call's JSON.
BARE_JSON = ToolCallFormat("{", None, whole_reply=True, body="object")

# Text in a template that shows a format, most specific first (Apriel's template names <tool_call> too).
_SHOWN_BY = (
    ("<tool_calls>", APRIEL), ("<tool_call>\\n<function=", HERMES_XML), ("<tool_call>", HERMES),
    ("[TOOL_CALLS]", MISTRAL), ("<|tool_call|>", GRANITE),
    ("<|tool_call_start|>", LFM2), ("<|START_ACTION|>", COMMAND_R), ("<｜tool▁calls▁begin｜>", DEEPSEEK),
    ("<|tool_calls_section_begin|>", KIMI), ("<|tool_calls|>", SOLAR),
    ('"parameters": dictionary of argument name and its value', LLAMA3),
)


def tool_call_format(template_source: str) -> ToolCallFormat | None:
    """The format a chat template teaches its model, or None when it shows none of the known ones."""
    return next((call_format for shown, call_format in _SHOWN_BY if shown in template_source), None)


PROBE_NAME, PROBE_ARGUMENTS = "lse_probe_function", {"lse_probe_argument": 1}


def call_syntax(template: Any, call_format: ToolCallFormat) -> tuple[str, str, str] | None:
    """How the template writes one call between its format's markers, for formats whose calls sit between
    tokens (DeepSeek, Kimi, Solar): the text before the function's name, between the name and the JSON
    arguments, and after them, read off the template's rendering of an earlier call; None if it shows none."""
    call = {"id": "call00001", "type": "function",
            "function": {"name": PROBE_NAME, "arguments": json.dumps(PROBE_ARGUMENTS)}}
    messages = parse_chat({"messages": [{"role": "user", "content": "?"},
                                        {"role": "assistant", "content": None, "tool_calls": [call]}]}).messages
    tools = [{"type": "function", "function": {"name": PROBE_NAME, "parameters": {
        "type": "object", "properties": {"lse_probe_argument": {"type": "integer"}}}}}]
    try:
        text = template.render_raw(messages, tools=tools, add_generation_prompt=False)
    except Exception:   # a template that cannot render an earlier call shows no syntax
        return None
    start = text.rfind(call_format.open_marker)
    end = text.find(call_format.close_marker or "\0", start)
    arguments = re.search(r"\{\s*\"lse_probe_argument\"\s*:\s*1\s*\}", text[start:end]) if start >= 0 else None
    name = text.find(PROBE_NAME, start)
    if arguments is None or end < 0 or not start <= name < start + arguments.start():
        return None
    inner = text[start + len(call_format.open_marker):end]
    before, after_name = inner.split(PROBE_NAME, 1)
    middle, after = after_name.split(arguments[0], 1)
    return before, middle, after


def _partial_marker(text: str, marker: str) -> int:
    """The length of the longest suffix of text that is a proper prefix of marker."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def openai_call(name: str, arguments: Any, short_id: bool = False) -> dict[str, Any]:
    """One entry of OpenAI's message.tool_calls; arguments travel as a JSON string."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    alphabet = string.ascii_letters + string.digits
    call_id = "".join(secrets.choice(alphabet) for _ in range(9)) if short_id else f"call_{secrets.token_hex(12)}"
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# ---- a block's text -> (name, arguments) pairs, or None ----

def _json_calls(block: str) -> list[tuple[str, Any]] | None:
    try:
        value = json.loads(block)
    except ValueError:
        return None
    objects = value if isinstance(value, list) else [value]
    calls = []
    for o in objects:
        if not isinstance(o, dict):
            return None
        name = o.get("name", o.get("tool_name"))    # Command R names it tool_name
        if not isinstance(name, str):
            return None
        try:
            calls.append((name, _arguments(o.get("arguments", o.get("parameters", {})))))
        except ValueError:
            return None
    return calls or None


_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
_GLM_CALL = re.compile(r"([\w.:-]+)\s*((?:<arg_key>.*?</arg_key>\s*<arg_value>.*?</arg_value>\s*)*)", re.S)
_GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _xml_calls(block: str, types: dict[str, dict[str, Any]]) -> list[tuple[str, Any]] | None:
    """Qwen3-Coder's <function=name><parameter=key>value</parameter></function>, one or more."""
    functions = _XML_FUNCTION.findall(block)
    if not functions or _XML_FUNCTION.sub("", block).strip():
        return None
    return [(name, {key: _typed(value, types.get(name, {}).get(key)) for key, value in _XML_PARAMETER.findall(body)})
            for name, body in functions]


def _glm_calls(block: str, types: dict[str, dict[str, Any]]) -> list[tuple[str, Any]] | None:
    """GLM's name<arg_key>key</arg_key><arg_value>value</arg_value>..., one call a block. A bare name
    counts only when it is an offered tool's: any word would pass for one."""
    match = _GLM_CALL.fullmatch(block)
    if match is None or not (match[2] or match[1] in types):
        return None
    name, declared = match[1], types.get(match[1], {})
    return [(name, {key: _typed(value, declared.get(key)) for key, value in _GLM_ARGUMENT.findall(match[2])})]


def _python_calls(block: str) -> list[tuple[str, Any]] | None:
    """LFM2's [name(key=value, ...), ...], values Python literals."""
    try:
        tree = ast.parse(block, mode="eval").body
        nodes = tree.elts if isinstance(tree, ast.List) else [tree]
        if not all(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and not n.args
                   and all(k.arg for k in n.keywords) for n in nodes):
            return None
        return [(n.func.id, {k.arg: ast.literal_eval(k.value) for k in n.keywords}) for n in nodes] or None
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return None


# one call between tokens: (name, JSON arguments)
_TAGGED_CALLS = (
    re.compile(r"<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>)?([^<\n]+?)(?:<｜tool▁sep｜>|\n```json\n)(.*?)(?:\n```)?"
               r"<｜tool▁call▁end｜>", re.S),
    re.compile(r"<\|tool_call_begin\|>\s*(?:functions\.)?([^:<\s]+)(?::\d+)?\s*<\|tool_call_argument_begin\|>(.*?)"
               r"<\|tool_call_end\|>", re.S),
    re.compile(r"<\|tool_call:begin\|>.*?<\|tool_call:name\|>(.*?)<\|tool_call:args\|>(.*?)<\|tool_call:end\|>", re.S),
)


def _tagged_calls(block: str) -> list[tuple[str, Any]] | None:
    """DeepSeek's, Kimi's and Solar's calls: a name and JSON arguments between special tokens."""
    for pattern in _TAGGED_CALLS:
        found = pattern.findall(block)
        if found and not pattern.sub("", block).strip():
            try:
                return [(name.strip(), _arguments(json.loads(text))) for name, text in found]
            except ValueError:
                return None
    return None


def _arguments(value: Any) -> Any:
    """Arguments as an object; some templates show them as a JSON string of it (raises ValueError if bad)."""
    return json.loads(value) if isinstance(value, str) else value


def _typed(value: str, schema_type: Any) -> Any:
    """An XML-written argument: text for a string parameter (or one the tools do not describe), else JSON.
    ``schema_type`` is the parameter's JSON-schema type: a name, or a list of them."""
    if schema_type is None or "string" in (schema_type if isinstance(schema_type, list) else [schema_type]):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def parse_calls(block: str, types: dict[str, dict[str, Any]] | None = None,
                short_ids: bool = False) -> list[dict[str, Any]] | None:
    """The calls written in one block, or None when it holds none. ``types``: tool name -> parameter name
    -> the JSON type the tools declare, for arguments written as text."""
    block, types = block.strip(), types or {}
    calls = (_json_calls(block) or _xml_calls(block, types) or _glm_calls(block, types)
             or _python_calls(block) or _tagged_calls(block))
    if calls is None or not all(isinstance(arguments, dict) for _, arguments in calls):
        return None
    return [openai_call(name, arguments, short_ids) for name, arguments in calls]


def parameter_types(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """tool name -> parameter name -> its declared JSON type, from a request's tools (checked by
    lse_core.protocol: a function has a name, its parameters are an object)."""
    types: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        function = tool["function"]
        properties = (function.get("parameters") or {}).get("properties")
        if isinstance(properties, dict):
            types[function["name"]] = {k: v.get("type") for k, v in properties.items() if isinstance(v, dict)}
    return types


class ToolCallParser:
    """feed() content deltas, get the content to stream; finish() gives the held-back content and the calls.

    Whitespace between content and a block, and right after a parsed block, is dropped: a reply of calls
    alone has no content. A block that does not parse is given back with the whitespace before it.

    Small models often answer a call as a bare JSON object without the template's markers ({"name":
    "get_weather", "arguments": {...}}): a reply that starts with "{" is held to its end, and is a call
    when it parses as calls of offered tools, content otherwise."""

    def __init__(self, call_format: ToolCallFormat, tools: list[dict[str, Any]] | None = None) -> None:
        self.format = call_format
        self.types = parameter_types(tools)
        self.names = {tool["function"]["name"] for tool in tools or []}
        self.bare: bool | None = None      # the reply may be a bare JSON call; None until its first character
        self.calls: list[dict[str, Any]] = []
        self.pending = ""          # held-back text: a block's body when inside, else a possible marker
        self.inside = False
        self.before_block = ""     # the whitespace dropped before the open block, given back if it fails
        self.after_call = False    # drop whitespace until the next visible text
        self.started = False       # visible text has passed: a whole-reply block can no longer start

    def feed(self, text: str) -> str:
        self.pending += text
        if self.format.whole_reply:
            return self._feed_whole_reply()
        if self.bare is None and self.pending.strip():
            self.bare = self.pending.lstrip().startswith("{")
        if self.bare is not False:
            return ""
        content = ""
        while self.pending:
            if self.inside:
                close = self.format.close_marker
                end = self.pending.find(close) if close is not None else -1
                if end < 0:
                    break
                content += self._close_block(self.pending[:end], closed=True)
                self.pending = self.pending[end + len(close):]
                continue
            if self.after_call:
                self.pending = self.pending.lstrip()
                if not self.pending:
                    break
                self.after_call = False
            start = self.pending.find(self.format.open_marker)
            if start >= 0:
                before = self.pending[:start]
                visible = before.rstrip()
                content += visible
                self.before_block = before[len(visible):]
                self.pending = self.pending[start + len(self.format.open_marker):]
                self.inside = True
                continue
            # hold back a possible marker and the whitespace before it, which goes with a block
            held = len(self.pending) - _partial_marker(self.pending, self.format.open_marker)
            visible = self.pending[:held].rstrip()
            content += visible
            self.pending = self.pending[len(visible):]
            break
        return content

    def _feed_whole_reply(self) -> str:
        """Hold the reply while it can still be a call: it starts (after whitespace and the lead marker)
        with the open marker; anything else is content from its first character on."""
        if self.started:
            content, self.pending = self.pending, ""
            return content
        head = self.pending.lstrip()
        lead = self.format.lead
        if lead and (lead.startswith(head) or head.startswith(lead)):
            head = head[len(lead):].lstrip() if head.startswith(lead) else ""
        if not head or head.startswith(self.format.open_marker):
            self.inside = bool(head)
            return ""
        self.started = True
        content, self.pending = self.pending, ""
        return content

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The content still held back, and every call the reply made. A block left open is parsed as it
        stands (one that runs to the end always is)."""
        if self.bare:
            calls = parse_calls(self.pending, self.types, self.format.short_ids)
            if calls and all(call["function"]["name"] in self.names for call in calls):
                self.pending = ""
                return "", calls
            self.bare = False
            held = self.feed("")
            more, calls = self.finish()
            return held + more, calls
        held, self.pending = self.pending, ""
        if self.format.whole_reply:
            body = held.lstrip().removeprefix(self.format.lead)
            calls = parse_calls(body, self.types, self.format.short_ids) if self.inside else None
            self.calls.extend(calls or [])
            return ("" if calls else held), self.calls
        content = self._close_block(held, closed=False) if self.inside else held
        return content, self.calls

    def _close_block(self, body: str, closed: bool) -> str:
        """Record the block's calls and return "", or return the block as written when it does not parse."""
        self.inside = False
        calls = parse_calls(body, self.types, self.format.short_ids)
        if calls is None:
            close = self.format.close_marker if closed else ""
            return self.before_block + self.format.open_marker + body + (close or "")
        self.calls.extend(calls)
        self.after_call = True
        return ""
