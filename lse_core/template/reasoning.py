"""Splits a streamed reply into reasoning and content at the template's reasoning markers (`<think>`...).

Text arrives in deltas and a marker may arrive split across them, so the splitter holds back only what could
still become a marker: a suffix that is a prefix of the marker it waits for, or, before the reply's first
visible text, leading whitespace and a possible opening marker.
"""

from __future__ import annotations

from lse_core.template.thinking import Level, TemplateThinking

THINK_MARKERS = ("<think>", "</think>")   # the spec's reasoning markers, where a template names none


def _partial_marker(text: str, marker: str) -> int:
    """The length of the longest suffix of text that is a proper prefix of marker."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


class ReasoningSplitter:
    """feed() text deltas, get (reasoning delta, content delta); finish() flushes what was held back.

    starts_inside: the generation prompt left a reasoning block open, so the reply begins as reasoning.
    Otherwise a reply the model itself opens with the open marker (after optional whitespace) is split the
    same way. The markers are dropped, and so is whitespace right after a marker.
    """

    def __init__(self, open_marker: str, close_marker: str, starts_inside: bool) -> None:
        self.open_marker = open_marker
        self.close_marker = close_marker
        self.inside = starts_inside
        self.at_start = not starts_inside    # the model may still open the block itself
        self.after_marker = starts_inside    # drop whitespace until the block's first visible text
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning, content = "", ""
        while self.pending:
            if self.after_marker:
                self.pending = self.pending.lstrip()
                if not self.pending:
                    break
                self.after_marker = False
            if self.at_start:
                stripped = self.pending.lstrip()
                if stripped.startswith(self.open_marker):
                    self.pending = stripped[len(self.open_marker):]
                    self.inside, self.at_start, self.after_marker = True, False, True
                    continue
                if self.open_marker.startswith(stripped):
                    break                     # whitespace or a possible opening marker: wait
                self.at_start = False
            if not self.inside:
                content += self.pending
                self.pending = ""
                break
            end = self.pending.find(self.close_marker)
            if end >= 0:
                reasoning += self.pending[:end]
                self.pending = self.pending[end + len(self.close_marker):]
                self.inside, self.after_marker = False, True
                continue
            keep = _partial_marker(self.pending, self.close_marker)
            reasoning += self.pending[:len(self.pending) - keep]
            self.pending = self.pending[len(self.pending) - keep:]
            break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The held-back text at the end of the reply: reasoning if the block never closed."""
        held, self.pending = self.pending, ""
        if self.after_marker:
            held = held.lstrip()
        return (held, "") if self.inside else ("", held)


def opens_reasoning(prompt: str, markers: tuple[str, str] | None) -> bool:
    """The prompt ends inside an unclosed reasoning block."""
    return markers is not None and markers[0] in prompt and prompt.rfind(markers[0]) > prompt.rfind(markers[1])


def reasoning_splitter(thinking: TemplateThinking, level: Level | None, prompt: str,
                       markers: tuple[str, str] | None = None) -> ReasoningSplitter | None:
    """The splitter for the reply to `prompt` (the rendered chat prompt, or a completion's own prompt) at the
    template's reasoning markers, else at ``markers``; None when there are neither or the level turns thinking
    off."""
    if thinking.open_marker is not None and thinking.close_marker is not None:
        markers = (thinking.open_marker, thinking.close_marker)
    if markers is None or (level is not None and not level.thinks):
        return None
    return ReasoningSplitter(*markers, starts_inside=opens_reasoning(prompt, markers))
