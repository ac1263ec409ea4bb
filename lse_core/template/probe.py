"""Derives a model's thinking levels from its chat template, by rendering probe conversations.

Nothing here knows a model: the toggle is `enable_thinking` when setting it changes the rendering, the effort
values are the string constants the template compares `reasoning_effort` against (found in its parsed AST), and
each level's instruction, generation prompt and reasoning markers are read off diffs between renderings.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from jinja2 import nodes

from lse_core.template.diff import added_text, appended_prompt, level_units, message_markup, system_frames
from lse_core.template.reasoning import opens_reasoning
from lse_core.template.render import ChatTemplate, TemplateLimitError, describe_error, time_limit
from lse_core.template.thinking import EFFORT, TOGGLE, Level, TemplateThinking

SYSTEM_TEXT = "LSE probe system prompt."
USER_TEXT = "LSE probe user message."
REPLY_TEXT = "LSE probe assistant reply."
CONVERSATIONS = (
    ({"role": "system", "content": SYSTEM_TEXT}, {"role": "user", "content": USER_TEXT}),
    ({"role": "user", "content": USER_TEXT},),
    ({"role": "user", "content": USER_TEXT}, {"role": "assistant", "content": REPLY_TEXT}),
)
# The levels are read off the first two; the third only shows which tag frames an assistant turn.
WITH_SYSTEM, USER_ONLY, WITH_REPLY = 0, 1, 2
# A tool for templates that render only with tools (the tool_use variants), tried when none fails.
PROBE_TOOLS = [{"type": "function", "function": {
    "name": "lse_probe", "description": "LSE probe tool.",
    "parameters": {"type": "object", "properties": {"x": {"type": "string", "description": "x"}}, "required": []}}}]
# An effort value no template names: renderings equal to it are the template ignoring the value.
UNKNOWN_EFFORT = "lse-probe-unknown-effort"
# XML-style tags (`<think>`, `</think>`); `<|im_start|>`-style special tokens are not reasoning markers.
TAG = re.compile(r"</?([A-Za-z][\w.-]*)>")
OPENED_AT_END = re.compile(r"<([A-Za-z][\w.-]*)>\s*$")

_EQUALITY = {"eq", "ne"}
_EQUALITY_TESTS = {"eq", "equalto", "==", "sameas", "ne", "!="}
_MEMBERSHIP = {"in", "notin"}


@dataclass(frozen=True)
class _Failed:
    """A rendering that raised; equal to another failure with the same message."""
    message: str


Rendering = str | _Failed


class _Renderer:
    """Renders the probe conversations, each (conversation, variables, add_generation_prompt) once."""

    def __init__(self, template: ChatTemplate, tools: list[dict[str, Any]] | None) -> None:
        self.template = template
        self.tools = tools
        self.cache: dict[tuple[int, tuple, bool], Rendering] = {}

    def render(self, conversation: int, variables: dict[str, Any], generation_prompt: bool = True) -> Rendering:
        key = (conversation, tuple(sorted(variables.items())), generation_prompt)
        if key not in self.cache:
            try:
                self.cache[key] = self.template.render_raw(
                    [dict(m) for m in CONVERSATIONS[conversation]], add_generation_prompt=generation_prompt,
                    tools=self.tools, **variables)
            except TemplateLimitError:
                raise
            except Exception as error:
                self.cache[key] = _Failed(describe_error(error))
        return self.cache[key]


def _plain_renderer(template: ChatTemplate) -> tuple[_Renderer, list[int]]:
    """A renderer and the conversations the template renders with no variables set; StartupError when the
    user-only conversation renders neither without tools nor with one."""
    failure = None
    for tools in (None, PROBE_TOOLS):
        renderer = _Renderer(template, tools)
        usable = [c for c in (WITH_SYSTEM, USER_ONLY) if isinstance(renderer.render(c, {}), str)]
        if USER_ONLY in usable:
            return renderer, usable
        failure = failure or renderer.render(USER_ONLY, {})
    raise template.startup_error(failure.message)


# --- effort candidates from the AST -------------------------------------------------------------------------


def _names(node: nodes.Node) -> Iterator[str]:
    """The variables an expression reads, namespace attributes (`ns.effort`) included."""
    for part in [node, *node.find_all((nodes.Name, nodes.Getattr))]:
        if isinstance(part, nodes.Name):
            yield part.name
        elif isinstance(part, nodes.Getattr) and isinstance(part.node, nodes.Name):
            yield f"{part.node.name}.{part.attr}"


def _target_names(target: nodes.Node) -> list[str]:
    if isinstance(target, nodes.NSRef):
        return [f"{target.name}.{target.attr}"]
    names = [target] if isinstance(target, nodes.Name) else target.find_all(nodes.Name)
    return [name.name for name in names]


def _effort_variables(ast: nodes.Template) -> set[str]:
    """reasoning_effort and every variable assigned, transitively, from an expression that reads it."""
    tracked = {EFFORT}
    assignments = [(_target_names(a.target), set(_names(a.node))) for a in ast.find_all(nodes.Assign)]
    grown = True
    while grown:
        grown = False
        for targets, reads in assignments:
            if reads & tracked and not set(targets) <= tracked:
                tracked.update(targets)
                grown = True
    return tracked


def _string_lists(ast: nodes.Template) -> dict[str, list[str]]:
    """Variables set to a literal list or tuple of strings (`set efforts = ['low', 'high']`)."""
    lists = {}
    for assign in ast.find_all(nodes.Assign):
        if isinstance(assign.target, nodes.Name) and (strings := _strings(assign.node)):
            lists[assign.target.name] = strings
    return lists


def _strings(node: nodes.Node) -> list[str]:
    if isinstance(node, nodes.Const) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, nodes.List | nodes.Tuple):
        return [item.value for item in node.items if isinstance(item, nodes.Const) and isinstance(item.value, str)]
    return []


def effort_candidates(ast: nodes.Template) -> list[str]:
    """String constants compared with reasoning_effort or a variable derived from it, in the template's order:
    ==, != and `is eq`-style tests against a string; in, not in and `is in` against a list, tuple or a variable
    holding one."""
    tracked = _effort_variables(ast)
    lists = _string_lists(ast)

    def reads_effort(node: nodes.Node) -> bool:
        return any(name in tracked for name in _names(node))

    def values(node: nodes.Node) -> list[str]:
        if isinstance(node, nodes.Name) and node.name in lists:
            return lists[node.name]
        return _strings(node)

    found: list[str] = []
    for node in ast.find_all((nodes.Compare, nodes.Test)):
        if isinstance(node, nodes.Test):
            op = "in" if node.name == "in" else "eq" if node.name in _EQUALITY_TESTS else None
            pairs = [(op, node.node, node.args[0])] if op and node.args else []
        else:
            operands = [node.expr] + [operand.expr for operand in node.ops]
            pairs = [(operand.op, left, operand.expr) for left, operand in zip(operands, node.ops)]
        for op, left, right in pairs:
            if op in _EQUALITY:
                for side, other in ((left, right), (right, left)):
                    if reads_effort(side) and isinstance(other, nodes.Const) and isinstance(other.value, str):
                        found.append(other.value)
            elif op in _MEMBERSHIP and reads_effort(left) and not isinstance(right, nodes.Const):
                found.extend(values(right))
    return list(dict.fromkeys(found))


# --- reasoning markers -------------------------------------------------------------------------------------


def _split_close_tags(ast: nodes.Template) -> list[str]:
    """Closing tags the template splits text on (`content.split('</think>')`): it strips reasoning there."""
    tags = []
    for call in ast.find_all(nodes.Call):
        if isinstance(call.node, nodes.Getattr) and call.node.attr in ("split", "rsplit", "partition"):
            tags.extend(value for arg in call.args for value in _strings(arg) if TAG.fullmatch(value)
                        and value.startswith("</"))
    return tags


def _frames_reply(history: str | None, name: str) -> bool:
    """The tag encloses the assistant's reply in the history: it is the assistant's turn, not its reasoning."""
    if history is None or REPLY_TEXT not in history:
        return False
    before, after = history.split(REPLY_TEXT, 1)
    return opens_reasoning(before, (f"<{name}>", f"</{name}>")) and f"</{name}>" in after


def reasoning_markers(template: ChatTemplate, prompts: list[str], history: str | None) -> tuple[str, str] | None:
    """The template's reasoning block markers: an XML-style tag pair the template writes in both forms, and
    which it either strips from history (splits on the closing tag) or which the thinking switch adds to the
    generation prompts; or a tag a generation prompt ends by opening, since the reply then starts inside it,
    unless that tag frames the assistant's turn in `history` (a conversation with a reply, rendered). The last
    such tag in a generation prompt wins; else the first the template splits on."""
    split_names = [TAG.fullmatch(tag)[1] for tag in _split_close_tags(template.ast)]
    tag_sets = [{match[0] for match in TAG.finditer(prompt)} for prompt in prompts]
    switched = {TAG.fullmatch(tag)[1] for tag in set.union(*tag_sets) - set.intersection(*tag_sets)}

    def is_pair(name: str) -> bool:
        return f"<{name}>" in template.source and f"</{name}>" in template.source

    opened = {match[1] for prompt in prompts if (match := OPENED_AT_END.search(prompt))}
    candidates = {name for name in switched | set(split_names) if is_pair(name)} | \
        {name for name in opened if not _frames_reply(history, name)}
    for prompt in prompts:
        for match in reversed(list(TAG.finditer(prompt))):
            if match[1] in candidates:
                return f"<{match[1]}>", f"</{match[1]}>"
    name = next((name for name in split_names if is_pair(name)), None)
    return (f"<{name}>", f"</{name}>") if name else None


# --- the probe ---------------------------------------------------------------------------------------------


def probe(template: ChatTemplate | None) -> TemplateThinking:
    """The thinking levels of `template` (run once at load); no template gives supported false."""
    if template is None:
        return TemplateThinking()
    try:
        with time_limit():
            return _probe(template)
    except TemplateLimitError as error:
        raise template.startup_error(describe_error(error)) from error


def _probe(template: ChatTemplate) -> TemplateThinking:
    renderer, usable = _plain_renderer(template)

    def renderings(variables: dict[str, Any]) -> tuple[Rendering, ...]:
        return tuple(renderer.render(c, variables) for c in usable)

    def all_render(results: tuple[Rendering, ...]) -> bool:
        return all(isinstance(r, str) for r in results)

    thinking_on, thinking_off = renderings({TOGGLE: True}), renderings({TOGGLE: False})
    has_toggle = all_render(thinking_on) and all_render(thinking_off) and thinking_on != thinking_off
    effort_base = {TOGGLE: True} if has_toggle else {}
    ignored = renderings({**effort_base, EFFORT: UNKNOWN_EFFORT})
    efforts = [value for value in effort_candidates(template.ast)
               if all_render(found := renderings({**effort_base, EFFORT: value})) and found != ignored]

    choices: list[tuple[str, bool | None, str | None]] = []
    if has_toggle:
        choices.append(("none", False, None))
    choices += [(value, True if has_toggle else None, value) for value in efforts]
    if has_toggle and not efforts:
        choices.append(("on", True, None))

    def variables_of(enable: bool | None, effort: str | None) -> dict[str, Any]:
        return {k: v for k, v in ((TOGGLE, enable), (EFFORT, effort)) if v is not None}

    def prompt_for(variables: dict[str, Any]) -> str:
        without = renderer.render(USER_ONLY, variables, generation_prompt=False)
        return appended_prompt(renderer.render(USER_ONLY, variables), without if isinstance(without, str) else "")

    plain = renderings({})
    default_id = next((cid for cid, enable, effort in choices if renderings(variables_of(enable, effort)) == plain),
                      None)
    prompts = [prompt_for(variables_of(enable, effort)) for _, enable, effort in choices]
    history = renderer.render(WITH_REPLY, {}, generation_prompt=False)
    markers = reasoning_markers(template, [*prompts, prompt_for({})], history if isinstance(history, str) else None)
    instructions = _instructions(renderer, usable, has_toggle,
                                 [variables_of(enable, effort) for _, enable, effort in choices])

    levels = []
    for (cid, enable, effort), prompt, instruction in zip(choices, prompts, instructions):
        levels.append(Level(id=cid, enable_thinking=enable, reasoning_effort=effort, instruction=instruction,
                            generation_prompt=prompt, opens_reasoning=opens_reasoning(prompt, markers),
                            default=cid == default_id))
    return TemplateThinking(source=template.path, toggle=TOGGLE if has_toggle else None,
                            effort=EFFORT if efforts else None, levels=tuple(levels),
                            open_marker=markers[0] if markers else None, close_marker=markers[1] if markers else None)


def _instructions(renderer: _Renderer, usable: list[int], has_toggle: bool,
                  levels: list[dict[str, Any]]) -> list[str | None]:
    """The instructions of the levels, from their variables: the text a level's rendering (without the
    generation prompt, which the level's generation_prompt holds) adds before the system prompt (the spec's
    instruction; text a level writes after it is no instruction) over the rendering without a level. That
    is thinking off where the template has the switch, else an effort value the template ignores, else (a
    template that refuses every other value) its rendering with no variables, unless that is a level's own:
    then the text where the levels' renderings differ is each one's, or, when a level writes none there, what
    the others add over it. Read off the conversation with a system prompt when the template takes one (else
    the text before the user's message); an instruction written as its own system message is its text alone."""
    conversation = WITH_SYSTEM if WITH_SYSTEM in usable else USER_ONLY
    first_message = SYSTEM_TEXT if conversation == WITH_SYSTEM else USER_TEXT

    def text(c: int, variables: dict[str, Any]) -> Rendering:
        return renderer.render(c, variables, generation_prompt=False)

    def before_first_message(rendering: Rendering) -> Rendering:
        return rendering.partition(first_message)[0] if isinstance(rendering, str) else rendering

    no_level = {TOGGLE: False} if has_toggle else {EFFORT: UNKNOWN_EFFORT}
    if not isinstance(text(conversation, no_level), str):
        no_level = {}
    baseline, without_system = text(conversation, no_level), text(USER_ONLY, no_level)
    frames = system_frames(baseline, without_system, SYSTEM_TEXT) \
        if conversation == WITH_SYSTEM and isinstance(baseline, str) and isinstance(without_system, str) else []
    whole = [text(conversation, variables) for variables in levels]
    baseline, renderings = before_first_message(baseline), [before_first_message(r) for r in whole]
    strings = [rendering for rendering in renderings if isinstance(rendering, str)]
    if not no_level and len(strings) == len(renderings) and baseline in strings and len(set(strings)) > 1:
        contents = [SYSTEM_TEXT, USER_TEXT]
        units = level_units(strings, contents, [mark for r in whole for mark in message_markup(r, contents)])
        if None not in units:
            return units
        baseline = strings[units.index(None)]
    return [added_text(rendering, baseline, frames) if isinstance(rendering, str) and isinstance(baseline, str)
            else None for rendering in renderings]
