"""How many tokens a reply may have, and the context checks around it.

A request's token limit is the first that is set of: the request's max_tokens (or
max_completion_tokens); the operator's cap (--max-tokens; a request above it is a 400); the model's
generation_config.json max_new_tokens; no limit. generation_config.json max_length bounds prompt +
reply for all but the request's own limit. The context always bounds prompt + reply.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import TypeAdapter, computed_field
from pydantic.dataclasses import dataclass as pydantic_dataclass

from lse_core.adapters.common import REPLY_PART, Count
from lse_core.errors import LSEError, invalid_request
from lse_core.sampling import GenerationDefaults


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


def check_prompt_text(length: int, longest: int, context_length: int, param: str) -> None:
    """Refuse (400 context_full) a prompt of ``length`` bytes or characters, before it is tokenized, when
    even its fewest possible tokens cannot fit: ``longest`` is the most a prompt that fits can have."""
    if length > longest:
        raise prompt_too_long(longest, context_length, param)


def prompt_too_long(longest: int, context_length: int, param: str) -> LSEError:
    return invalid_request(
        f"the prompt is over {longest} bytes, more than any prompt that fits the context of {context_length} "
        "tokens; compact or shorten the conversation",
        "context_full", param, lse_context=lse_context(context_length, context_length))


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

