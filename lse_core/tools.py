"""Tool calls in a reply: the format comes from the chat template's text, the calls from a streaming parser.

Hermes/Qwen templates teach the model to write `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
Mistral's write `[TOOL_CALLS]` followed by a JSON list of such objects that runs to the end of the reply.
The parser is fed the reply's content deltas: text outside call blocks passes through, text inside is held
back, and so is whatever could still become a marker. A block that does not parse into calls is given back
as content, markers and all, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCallFormat:
    """open_marker starts a call block; close_marker ends it, or None when the block runs to the reply's end.
    json_list: the block holds a JSON list of calls rather than one call."""

    open_marker: str
    close_marker: str | None
    json_list: bool


HERMES = ToolCallFormat("<tool_call>", "</tool_call>", json_list=False)
MISTRAL = ToolCallFormat("[TOOL_CALLS]", None, json_list=True)


def tool_call_format(template_source: str) -> ToolCallFormat | None:
    """The format a chat template teaches its model, or None when it shows none of the known markers."""
    for candidate in (HERMES, MISTRAL):
        if candidate.open_marker in template_source:
            return candidate
    return None


def _partial_marker(text: str, marker: str) -> int:
    """The length of the longest suffix of text that is a proper prefix of marker."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def openai_call(name: str, arguments: Any) -> dict[str, Any]:
    """One entry of OpenAI's message.tool_calls; arguments travel as a JSON string."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_calls(block: str, json_list: bool) -> list[dict[str, Any]] | None:
    """The calls in one block's text, or None when it is not JSON objects each with a string name."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    objects = value if json_list and isinstance(value, list) else [value]
    if not objects or not all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in objects):
        return None
    return [openai_call(o["name"], o.get("arguments", {})) for o in objects]


class ToolCallParser:
    """feed() content deltas, get the content to stream; finish() gives the held-back content and the calls.

    Whitespace between content and a block, and right after a parsed block, is dropped: a reply of calls
    alone has no content. A block that does not parse is given back with the whitespace before it."""

    def __init__(self, call_format: ToolCallFormat) -> None:
        self.format = call_format
        self.calls: list[dict[str, Any]] = []
        self.pending = ""          # held-back text: a block's body when inside, else a possible marker
        self.inside = False
        self.before_block = ""     # the whitespace dropped before the open block, given back if it fails
        self.after_call = False    # drop whitespace until the next visible text

    def feed(self, text: str) -> str:
        self.pending += text
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

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The content still held back, and every call the reply made. A block left open is parsed as it
        stands (Mistral's always is: it runs to the end)."""
        held, self.pending = self.pending, ""
        content = self._close_block(held, closed=False) if self.inside else held
        return content, self.calls

    def _close_block(self, body: str, closed: bool) -> str:
        """Record the block's calls and return "", or return the block as written when it does not parse."""
        self.inside = False
        calls = parse_calls(body.strip(), self.format.json_list)
        if calls is None:
            close = self.format.close_marker if closed else ""
            return self.before_block + self.format.open_marker + body + (close or "")
        self.calls.extend(calls)
        self.after_call = True
        return ""
