"""What one rendering of a chat template adds over another, read off a character diff.

An insertion beside characters that repeat at its ends reads at several offsets ("a." + "\\n\\nb." is also
"a.\\n\\nb" + "."), so each inserted span is taken in the reading that is a whole system message, as the
template frames one, or else the reading with the most whitespace at its ends, which splits at word boundaries.
"""

from __future__ import annotations

import difflib

Frame = tuple[str, str]    # the text a template writes before and after a system message's content


def common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _common_suffix(a: str, b: str, limit: int) -> int:
    n = 0
    while n < limit and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def appended_prompt(with_prompt: str, without_prompt: str) -> str:
    """What add_generation_prompt=True appends over False."""
    return with_prompt[common_prefix(with_prompt, without_prompt):]


def _readings(text: str, start: int, end: int, low: int, high: int) -> list[str]:
    """Every reading of the insertion text[start:end] that slides only over unchanged text, text[low:high]."""
    while start > low and text[start - 1] == text[end - 1]:
        start, end = start - 1, end - 1
    readings = [text[start:end]]
    while end < high and text[start] == text[end]:
        start, end = start + 1, end + 1
        readings.append(text[start:end])
    return readings


def _unframed(readings: list[str], frames: list[Frame]) -> str:
    for reading in readings:
        for head, tail in frames:
            if len(reading) > len(head) + len(tail) and reading.startswith(head) and reading.endswith(tail):
                return reading[len(head):len(reading) - len(tail)].strip()
    return min((reading.strip() for reading in readings), key=len)


def added_text(rendering: str, baseline: str, frames: list[Frame] | None = None) -> str | None:
    """The text `rendering` has that `baseline` lacks, wherever it stands, or None when it adds none. Text the
    baseline also has in another form (a changed word, or a word the baseline writes with more letters) counts as
    the rendering's own; a span that is a whole system message (framed as one of `frames`) counts without its
    frame. Separate spans are joined by a line."""
    start = common_prefix(rendering, baseline)
    trim = _common_suffix(rendering, baseline, min(len(rendering), len(baseline)) - start)
    end = len(rendering) - trim
    # The trimmed middles are short: the diff runs there, and its offsets are shifted back by `start`.
    opcodes = difflib.SequenceMatcher(None, baseline[start:len(baseline) - trim], rendering[start:end],
                                      autojunk=False).get_opcodes()
    pieces = []
    for k, (op, i1, i2, j1, j2) in enumerate(opcodes):
        if op == "insert":
            low = start + opcodes[k - 1][3] if k > 0 else 0
            high = start + opcodes[k + 1][4] if k + 1 < len(opcodes) else len(rendering)
            pieces.append(_unframed(_readings(rendering, start + j1, start + j2, low, high), frames or []))
        elif op == "replace":
            pieces.append(rendering[start + j1:start + j2].strip())
        elif op == "delete" and not any(c.isspace() for c in baseline[start + i1:start + i2]):
            pieces.append(_word_at(rendering, start + j1))   # a word that lost letters: "/no_think" -> "/think"
    return "\n".join(piece for piece in pieces if piece) or None


def _word_at(text: str, at: int) -> str:
    """The word (run of non-whitespace characters) around position ``at`` of ``text``; empty between two
    whitespace characters, where a whole word was deleted."""
    low, high = at, at
    while low > 0 and not text[low - 1].isspace():
        low -= 1
    while high < len(text) and not text[high].isspace():
        high += 1
    return text[low:high]


def system_frames(with_system: str, without_system: str, system_text: str) -> list[Frame]:
    """How the template frames a system message: the text around `system_text` in each reading of what a
    conversation with the system message adds over the same conversation without it. Empty when the two
    differ by more than that one insertion, or the frame is only whitespace."""
    start = common_prefix(with_system, without_system)
    added = len(with_system) - len(without_system)
    if added <= 0 or with_system[start + added:] != without_system[start:]:
        return []
    frames = []
    for reading in _readings(with_system, start, start + added, 0, len(with_system)):
        head, found, tail = reading.partition(system_text)
        if found and system_text not in tail and (head + tail).strip():
            frames.append((head, tail))
    return frames


def message_markup(rendering: str, contents: list[str]) -> list[str]:
    """What the template writes on the line of each message whose content is one of `contents`, before and after
    that content: its markup for a message (`[INST]`, `<|im_end|>`)."""
    found = []
    for content in contents:
        at = rendering.find(content)
        if at >= 0:
            found += [rendering[:at].rsplit("\n", 1)[-1], rendering[at + len(content):].split("\n", 1)[0]]
    return [text for text in found if text]


def level_units(renderings: list[str], contents: list[str], markup: list[str] | None = None) -> list[str | None]:
    """Each rendering's own text where the renderings differ, for renderings none of which lacks the text (a
    template that writes one of several sentences there): the differing region, widened over the text all of
    them share to the enclosing unit, stripped; None where that is empty. A unit ends at a line break, a
    message's markup, the content of one of the messages (`contents`, which is never a level's) or the
    rendering's ends. Sentence ends are no boundary, since the levels' texts can share sentences that are
    still each level's text ("Reasoning: low. Be concise." and "Reasoning: high. Be concise."). ``markup``: the
    message markup (message_markup) read off whole renderings, for renderings cut short of the messages."""
    start = min(common_prefix(renderings[0], rendering) for rendering in renderings)
    limit = min(len(rendering) for rendering in renderings) - start
    trim = min(_common_suffix(renderings[0], rendering, limit) for rendering in renderings)
    units = []
    for rendering in renderings:
        marks = ["\n", *(message_markup(rendering, contents) if markup is None else markup), *contents]
        low = max((at + len(mark) for mark in marks if (at := rendering.rfind(mark, 0, start)) >= 0), default=0)
        high = min((at for mark in marks if (at := rendering.find(mark, len(rendering) - trim)) >= 0),
                   default=len(rendering))
        units.append(rendering[low:high].strip() or None)
    return units
