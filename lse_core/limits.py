"""How many tokens a reply may have, and the context checks around it.

A request's token limit is the first that is set of: the request's max_tokens (or
max_completion_tokens); the operator's cap (--max-tokens; a request above it is a 400); the model's
generation_config.json max_new_tokens; no limit. generation_config.json max_length bounds prompt +
reply for all but the request's own limit. The context always bounds prompt + reply.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import TypeAdapter, computed_field
from pydantic.dataclasses import dataclass as pydantic_dataclass

from lse_core.adapters.common import REPLY_PART, Count
from lse_core.errors import LSEError, invalid_request
from lse_core.model.tokenizer import Tokenizer
from lse_core.sampling import GenerationDefaults

SAMPLE_WINDOWS = 8     # the pieces of a prompt too long to tokenize whole that its size is read off
_SPACE = re.compile(r"\s")


@dataclass(frozen=True)
class TokenLimit:
    """``max_new_tokens`` reply tokens may come; a reply that reaches that many ends with
    finish_reason "length" and ``stop_reason`` ("max_tokens", or "context_full" when the context is
    what bounds it). max_new_tokens is 0 only when generation_config.json's max_length leaves the
    prompt no room: the reply is then empty."""

    max_new_tokens: int
    stop_reason: str


@pydantic_dataclass(config=REPLY_PART)
class LSEContext:
    """The lse_context object of responses, final chunks and context_full errors (spec/API.md)."""

    tokens_used: Count        # prompt tokens, cached ones included, plus reply tokens
    context_length: Count

    @computed_field
    @property
    def tokens_remaining(self) -> int:
        return max(self.context_length - self.tokens_used, 0)


_LSE_CONTEXT = TypeAdapter(LSEContext)


def lse_context(tokens_used: int, context_length: int) -> dict[str, int]:
    """The lse_context object as JSON."""
    return _LSE_CONTEXT.dump_python(LSEContext(tokens_used, context_length))


def check_prompt(prompt_tokens: int, context_length: int, param: str) -> None:
    """Refuse a prompt that leaves no room for a reply (400 context_full). ``param`` is "messages"
    on /v1/chat/completions and "prompt" on /v1/completions."""
    if prompt_tokens >= context_length:
        raise invalid_request(
            f"the prompt is {prompt_tokens} tokens and the context holds {context_length}; "
            "compact or shorten the conversation",
            "context_full", param, lse_context=lse_context(prompt_tokens, context_length))


def check_prompt_text(text: str, tokenizer: Tokenizer, context_length: int, param: str,
                      add_special: bool = False) -> None:
    """Refuse (400 context_full) a prompt ``text`` whose UTF-8 bytes are more than any prompt that fits the
    context can have, before it is tokenized whole: tokenizing megabytes takes seconds. Its lse_context still
    reports the prompt's size: prompt_tokens counts it, with the tokenizer's special tokens when ``add_special``
    (a completion's prompt; a chat's messages are counted without their template's few)."""
    longest = tokenizer.longest_text(context_length)
    if len(text.encode()) > longest:
        special = len(tokenizer.encode("", add_special_tokens=True)) if add_special else 0
        raise prompt_too_long(prompt_tokens(text, tokenizer, longest) + special, longest, context_length, param)


def prompt_tokens(text: str, tokenizer: Tokenizer, budget: int) -> int:
    """The tokens of ``text`` (no special tokens), at the cost of tokenizing at most ``budget`` characters: all
    of them for a text that short, else SAMPLE_WINDOWS evenly spaced windows of it, each cut at whitespace, that
    hold ``budget`` characters together, their tokens per character times the text's characters."""
    if len(text) <= budget:
        return len(tokenizer.encode(text, add_special_tokens=False))
    width = max(budget // SAMPLE_WINDOWS, 1)
    step = (len(text) - width) // (SAMPLE_WINDOWS - 1)
    starts = [_space_at(text, i * step) for i in range(SAMPLE_WINDOWS)]
    windows = [text[start:_space_at(text, start + width)] for start in starts]
    tokens = sum(len(tokenizer.encode(window, add_special_tokens=False)) for window in windows)
    return round(tokens * len(text) / sum(len(window) for window in windows))


def _space_at(text: str, at: int) -> int:
    """The first whitespace from ``at`` on, within 64 characters (so a window starts and ends between words
    where the text has words), else ``at``."""
    found = _SPACE.search(text, at, at + 64)
    return found.start() if found else at


def prompt_too_long(tokens: int, longest: int, context_length: int, param: str) -> LSEError:
    """The context_full error of a prompt over ``longest`` bytes, refused before it was tokenized whole; ``tokens``
    is its size as prompt_tokens counts it (lse_context reports no fewer than the context holds: it never fits)."""
    return invalid_request(
        f"the prompt is over {longest} bytes (about {tokens} tokens), more than any prompt that fits the context of "
        f"{context_length} tokens; compact or shorten the conversation",
        "context_full", param, lse_context=lse_context(max(tokens, context_length), context_length))


def resolve_limit(max_tokens: int | None, operator_cap: int, defaults: GenerationDefaults,
                  prompt_tokens: int, context_length: int, param: str) -> TokenLimit:
    """The limit of one reply. ``max_tokens`` is the request's (None when not sent),
    ``operator_cap`` 0 means no cap, ``param`` names the prompt field for check_prompt's error.
    When the context and another limit allow the same number of tokens, the reply that reaches it
    has filled the context, so it reports context_full."""
    check_prompt(prompt_tokens, context_length, param)
    room = context_length - prompt_tokens
    limit: int | None
    if max_tokens is not None:
        if operator_cap and max_tokens > operator_cap:
            raise invalid_request(f"max_tokens is {max_tokens} and this server allows at most {operator_cap}",
                                  "invalid_value", "max_tokens")
        limit = max_tokens
    else:
        limit = operator_cap or defaults.max_new_tokens
        if defaults.max_length is not None:
            by_length = max(defaults.max_length - prompt_tokens, 0)
            limit = by_length if limit is None else min(limit, by_length)
    if limit is None or limit >= room:
        return TokenLimit(room, "context_full")
    return TokenLimit(limit, "max_tokens")

