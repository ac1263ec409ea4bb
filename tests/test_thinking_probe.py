"""The thinking probe on synthetic templates: a level's instruction is all the text the level adds before the
system prompt (the spec's "template text placed first in the system prompt"; what it writes after the system
prompt is none), and opens_reasoning says whether that level's generation prompt leaves a reasoning block open.
Each expectation is read off the template above it, not produced by the probe."""

from __future__ import annotations

import pytest

from lse_core.template.diff import added_text, system_frames
from lse_core.template.probe import probe
from lse_core.template.render import ChatTemplate
from lse_core.template.thinking import TemplateThinking

# Effort levels low and high, no switch; unset is high. The two texts share their first word.
EFFORT = r"""
{%- set effort = reasoning_effort | default('high') %}
{%- set level_text = 'Think briefly. ' if effort == 'low' else 'Think hard. ' if effort == 'high' else '' %}"""
TURNS = r"""
{%- for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}"""
OPEN_THINK = r"""
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}{% endif %}"""

# The case issue 23 found: the level's text goes first in the system prompt, and no </think> in the template.
LEVEL_TEXT_FIRST = r"""
{%- for m in messages %}
{{- '<|im_start|>' + m.role + '\n' + (level_text if m.role == 'system' else '') + m.content + '<|im_end|>\n' }}
{%- endfor %}"""
FIRST = EFFORT + LEVEL_TEXT_FIRST + OPEN_THINK
LAST = EFFORT + r"""
{%- for m in messages %}
{{- '<|im_start|>' + m.role + '\n' + m.content + ('\n\n' + level_text if m.role == 'system' else '') }}
{{- '<|im_end|>\n' }}
{%- endfor %}""" + OPEN_THINK
INSIDE = EFFORT + r"""
{%- for m in messages %}
{%- if m.role == 'system' %}
{{- '<|im_start|>system\n# Rules\nAnswer kindly.\n' + level_text + '\n# From the user\n' + m.content + '<|im_end|>\n' }}
{%- else %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endif %}
{%- endfor %}""" + OPEN_THINK
OWN_SYSTEM_MESSAGE = EFFORT + r"""
{%- if level_text %}{{ '<|im_start|>system\n' + level_text + '<|im_end|>\n' }}{% endif %}""" + TURNS + OPEN_THINK
# No system role: the level's text goes first in the first user turn.
NO_SYSTEM_ROLE = EFFORT + r"""
{%- for m in messages %}
{%- if m.role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}
{{- '<|im_start|>' + m.role + '\n' + (level_text if loop.first else '') + m.content + '<|im_end|>\n' }}
{%- endfor %}""" + OPEN_THINK
# The switch and effort levels: thinking on puts the level's text first, off closes the block at once.
TOGGLE_AND_LEVELS = r"""
{%- set thinking = enable_thinking is not defined or enable_thinking %}
{%- set effort = reasoning_effort | default('high') %}
{%- set level_text = '' %}
{%- if thinking and effort == 'low' %}{% set level_text = 'Think briefly.\n\n' %}
{%- elif thinking and effort == 'high' %}{% set level_text = 'Think hard.\n\n' %}{% endif %}
{%- for m in messages %}
{{- '<|im_start|>' + m.role + '\n' + (level_text if m.role == 'system' else '') + m.content + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' + ('<think>\n' if thinking else '<think>\n\n</think>\n\n') }}
{%- endif %}"""
# Only high opens the block in its generation prompt; low leaves thinking to the model.
OPENS_FOR_SOME = FIRST.replace(OPEN_THINK, r"""
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' + ('<think>\n\n' if effort == 'high' else '') }}
{%- endif %}""")
# The level writes text in two places: first in the system prompt, and after the user's message.
TWO_PLACES = EFFORT + r"""
{%- set reminder = {'low': '\n(Be quick.)', 'high': '\n(Take your time.)'}.get(effort, '') %}
{%- for m in messages %}
{{- '<|im_start|>' + m.role + '\n' + (level_text if m.role == 'system' else '') + m.content }}
{{- (reminder if m.role == 'user' else '') + '<|im_end|>\n' }}
{%- endfor %}""" + OPEN_THINK
# The switch changes a word before the system prompt, written for every level (SmolLM3's "/think" mode line).
MODE_WORD = r"""
{%- set mode = '/no_think' if enable_thinking is defined and not enable_thinking else '/think' %}
{{- '<|im_start|>system\nReasoning Mode: ' + mode + '\n\n' }}
{%- for m in messages %}{{ (m.content + '<|im_end|>\n' if m.role == 'system' else '<|im_start|>' + m.role + '\n'
                          + m.content + '<|im_end|>\n') }}{% endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"""
# The switch changes a word after the system prompt, in a block of its own (Apertus' "Deliberation: enabled").
AFTER_SYSTEM_WORD = r"""
{%- for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
{%- if m.role == 'system' %}{{ '<|im_start|>developer\nDeliberation: '
                               + ('enabled' if enable_thinking else 'disabled') + '<|im_end|>\n' }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' + ('<think>\n' if enable_thinking else '') }}{% endif %}"""
# XML-style role tags: the generation prompt ends by opening the assistant's turn, which is not reasoning.
XML_ROLES = r"""
{%- set effort = reasoning_effort | default('high') %}
{%- for m in messages %}{{ '<' + m.role + '>' + m.content + '</' + m.role + '>\n' }}{% endfor %}
{%- if add_generation_prompt %}{{ '<assistant>' + ('<think>' if effort == 'high' else '') }}{% endif %}"""

# Templates with no rendering that lacks a level: effort levels, no switch, any other value refused, and unset is
# a level. Each level's text is where the levels' renderings differ.
ONLY_LOW_OR_HIGH = r"""
{%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort is not none else 'high' %}
{%- if effort not in ('low', 'high') %}{{ raise_exception('reasoning_effort must be low or high') }}{% endif %}"""
ALWAYS_FIRST = ONLY_LOW_OR_HIGH + r"""
{%- set level_text = 'Think ' + effort + '. ' %}""" + LEVEL_TEXT_FIRST + OPEN_THINK
ALWAYS_LONGER = ONLY_LOW_OR_HIGH + r"""
{%- set level_text = 'Reasoning: ' + effort + '. Be concise. ' %}""" + LEVEL_TEXT_FIRST + OPEN_THINK
ALWAYS_OWN_LINE = ONLY_LOW_OR_HIGH + r"""
{%- set level_text = 'Reasoning: ' + effort + '. Be concise.\n' %}""" + LEVEL_TEXT_FIRST + OPEN_THINK
ALWAYS_THREE = r"""
{%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort is not none else 'medium' %}
{%- if effort not in ('low', 'medium', 'high') %}{{ raise_exception('unknown reasoning_effort') }}{% endif %}
{{- '<|im_start|>system\nThink ' + effort + '.<|im_end|>\n' }}""" + TURNS + OPEN_THINK
# Unset is medium, which writes no text: the others' texts are what they add over it.
ALWAYS_ONE_WRITES_NONE = ALWAYS_THREE.replace(r"""
{{- '<|im_start|>system\nThink ' + effort + '.<|im_end|>\n' }}""", r"""
{%- set level_text = {'low': 'Think briefly.\n', 'high': 'Think hard.\n'}.get(effort, '') %}""" + LEVEL_TEXT_FIRST)


def probed(source: str) -> TemplateThinking:
    return probe(ChatTemplate(source, "synthetic.jinja"))


def levels_of(thinking: TemplateThinking) -> list[tuple[str, str | None, bool, bool]]:
    return [(level.id, level.instruction, level.opens_reasoning, level.default) for level in thinking.levels]


@pytest.mark.parametrize("source", [FIRST, INSIDE, OWN_SYSTEM_MESSAGE, NO_SYSTEM_ROLE],
                         ids=["first", "inside", "own system message", "no system role"])
def test_each_level_gets_its_whole_text_wherever_it_stands_before_the_system_prompt(source: str) -> None:
    thinking = probed(source)
    assert (thinking.toggle, thinking.effort, thinking.default_level.id) == (None, "reasoning_effort", "high")
    assert levels_of(thinking) == [("low", "Think briefly.", True, False), ("high", "Think hard.", True, True)]


def test_text_after_the_system_prompt_is_no_instruction() -> None:
    """Bielik, Hy3 and Apertus write their thinking text after the system prompt: no level has an instruction."""
    assert levels_of(probed(LAST)) == [("low", None, True, False), ("high", None, True, True)]
    thinking = probed(AFTER_SYSTEM_WORD)
    assert (thinking.toggle, thinking.default_level.id) == ("enable_thinking", "none")
    assert levels_of(thinking) == [("none", None, False, True), ("on", None, True, False)]


def test_a_word_the_level_changes_before_the_system_prompt_is_its_instruction() -> None:
    """SmolLM3 writes "/think" (unset, or on) or "/no_think" (off) before the system prompt: "/think" is what the
    level "on" adds over thinking off, though the text it changes is shorter."""
    thinking = probed(MODE_WORD)
    assert (thinking.toggle, thinking.default_level.id) == ("enable_thinking", "on")
    assert levels_of(thinking) == [("none", None, False, False), ("on", "/think", False, True)]


def test_the_issue_template_opens_the_block_it_never_closes() -> None:
    thinking = probed(FIRST)
    assert (thinking.open_marker, thinking.close_marker) == ("<think>", "</think>")
    assert [level.generation_prompt for level in thinking.levels] == ["<|im_start|>assistant\n<think>\n"] * 2


def test_a_switch_and_levels() -> None:
    thinking = probed(TOGGLE_AND_LEVELS)
    assert (thinking.toggle, thinking.effort, thinking.default_level.id) == ("enable_thinking", "reasoning_effort",
                                                                             "high")
    assert levels_of(thinking) == [("none", None, False, False), ("low", "Think briefly.", True, False),
                                   ("high", "Think hard.", True, True)]
    assert thinking.level("none").generation_prompt == "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_opens_reasoning_per_level() -> None:
    thinking = probed(OPENS_FOR_SOME)
    assert levels_of(thinking) == [("low", "Think briefly.", False, False), ("high", "Think hard.", True, True)]
    assert (thinking.open_marker, thinking.close_marker) == ("<think>", "</think>")
    assert [level.generation_prompt for level in thinking.levels] == \
        ["<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n\n"]


def test_of_text_in_two_places_the_part_before_the_system_prompt_is_the_instruction() -> None:
    assert levels_of(probed(TWO_PLACES)) == [("low", "Think briefly.", True, False),
                                             ("high", "Think hard.", True, True)]


def test_a_role_tag_that_ends_the_generation_prompt_is_not_reasoning() -> None:
    thinking = probed(XML_ROLES)
    assert (thinking.open_marker, thinking.close_marker) == ("<think>", "</think>")
    assert [(level.id, level.opens_reasoning) for level in thinking.levels] == [("high", True)]
    plain = probed(XML_ROLES.replace("<think>", ""))   # the prompt ends with '<assistant>' for every value
    assert (plain.open_marker, plain.supported) == (None, False)


def test_an_insertion_is_read_at_word_boundaries() -> None:
    # "a." + "\n\nb." reads as "a.\n\nb" + "." too: the reading with whitespace at its ends is the text.
    assert added_text("<s>a.\n\nb.</s>", "<s>a.</s>") == "b."
    assert added_text("<s>a.</s>", "<s>a.</s>") is None
    assert added_text("<s>Mode: /think\n</s>", "<s>Mode: /no_think\n</s>") == "/think"   # a word lost letters
    assert added_text("<s>a b</s>", "<s>a x b</s>") is None                 # a whole word deleted adds nothing


def test_a_whole_system_message_is_its_text() -> None:
    baseline = "<s>[SYS]P.[/SYS][U]u[/U]"
    frames = system_frames(baseline, "<s>[U]u[/U]", "P.")
    assert ("[SYS]", "[/SYS]") in frames
    assert added_text("<s>[SYS]Think.[/SYS][SYS]P.[/SYS][U]u[/U]", baseline, frames) == "Think."
    assert added_text("<s>[SYS]P.[/SYS][SYS]Think.[/SYS][U]u[/U]", baseline, frames) == "Think."


@pytest.mark.parametrize("source, expected", [
    (ALWAYS_FIRST, [("low", "Think low.", False), ("high", "Think high.", True)]),
    (ALWAYS_LONGER, [("low", "Reasoning: low. Be concise.", False), ("high", "Reasoning: high. Be concise.", True)]),
    (ALWAYS_OWN_LINE, [("low", "Reasoning: low. Be concise.", False),
                       ("high", "Reasoning: high. Be concise.", True)]),
    (ALWAYS_THREE, [("low", "Think low.", False), ("medium", "Think medium.", True), ("high", "Think high.", False)]),
    (ALWAYS_ONE_WRITES_NONE, [("low", "Think briefly.", False), ("medium", None, True),
                              ("high", "Think hard.", False)]),
], ids=["first", "longer sentence", "own line", "three levels", "one writes none"])
def test_with_no_rendering_without_a_level_each_level_gets_its_text(
        source: str, expected: list[tuple[str, str | None, bool]]) -> None:
    thinking = probed(source)
    assert (thinking.toggle, thinking.effort) == (None, "reasoning_effort")
    assert [(level.id, level.instruction, level.default) for level in thinking.levels] == expected
