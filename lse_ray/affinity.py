"""Prefix affinity: which replica a request prefers, so a conversation's next turn finds its prefix cached.

A request's key hashes the leading tokens of its prompt that every later turn of the same conversation
starts with: a chat's messages through its first user turn (the system prompt, tools and the opening
question), rendered by the model's own template and tokenized as a replica would; a completion's first
COMPLETION_BLOCK tokens. The Responses and Messages bodies become chat bodies through the core's own
adapters first. The key picks replicas by rendezvous hashing (highest score first), a consistent hash: a
replica that joins or leaves moves only the keys it wins or held; a replica whose queue is too long is passed
over for the next in that order (bounded_choice).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from typing import Any

from lse_core.adapters import anthropic, responses
from lse_core.errors import LSEError
from lse_core.model.default import load_model
from lse_core.template.render import ChatTemplate, RenderTooLong

COMPLETION_BLOCK = 64          # a completion prompt's leading tokens that make its key
ROOT_MAX_CHARS = 64 << 10      # a conversation root longer than this is not keyed (nor rendered further)
LOAD_FACTOR = 1.5              # a replica whose queue is past this times the mean (plus one) is passed over


def token_key(tokens: Sequence[int]) -> int:
    """A 64-bit hash of token ids."""
    data = b"".join(int(t).to_bytes(4, "little", signed=True) for t in tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def rendezvous_order(key: int, replica_ids: Sequence[str]) -> list[str]:
    """The replicas in the order ``key`` prefers them: highest hash of (key, replica) first."""
    def score(replica_id: str) -> bytes:
        return hashlib.blake2b(f"{key}:{replica_id}".encode(), digest_size=8).digest()
    return sorted(replica_ids, key=score, reverse=True)


def bounded_choice(key: int, loads: dict[str, int]) -> str:
    """The replica for ``key`` given each replica's queue: the first in its rendezvous order whose queue is below
    LOAD_FACTOR times the mean with this request (consistent hashing with bounded loads, Mirrokni et al.)."""
    bound = math.ceil(LOAD_FACTOR * (sum(loads.values()) + 1) / len(loads))
    ordered = rendezvous_order(key, list(loads))
    return next((rid for rid in ordered if loads[rid] < bound), ordered[0])


class PromptKeys:
    """Affinity keys for request bodies, from the served model's tokenizer and chat template (its weights
    are memory-mapped, never read, so this costs the ingress little)."""

    def __init__(self, model_path: str | None) -> None:
        model = load_model(model_path)
        self.tokenizer = model.tokenizer
        self.template = None
        if model.chat_template is not None:
            self.template = ChatTemplate(model.chat_template, model.chat_template_source,
                                         model.tokenizer.template_variables())

    def key(self, path: str, body: bytes) -> int | None:
        """The key of a POST to ``path``, or None (no preference: the least-loaded replica takes it) when the
        body has no prompt to key, or is one the replica will refuse."""
        try:
            parsed = json.loads(body)
            if not isinstance(parsed, dict):
                return None
            if path == "/v1/completions":
                return self._completion_key(parsed.get("prompt"))
            if path == "/v1/messages":
                parsed, _ = anthropic.start(parsed, "")
            elif path == "/v1/responses":
                parsed, _ = responses.start(parsed, responses.ResponseStore(), "")
            elif path != "/v1/chat/completions":
                return None
            return self._chat_key(parsed.get("messages"), parsed.get("tools"))
        except (ValueError, LSEError, RenderTooLong, TypeError, KeyError, AttributeError):
            return None

    def _chat_key(self, messages: Any, tools: Any) -> int | None:
        if self.template is None or not isinstance(messages, list):
            return None
        first_user = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"), None)
        if first_user is None:
            return None
        root = self.template.render(messages[: first_user + 1], add_generation_prompt=False, tools=tools,
                                    max_chars=ROOT_MAX_CHARS)
        return token_key(self.tokenizer.encode(root, add_special_tokens=False))

    def _completion_key(self, prompt: Any) -> int | None:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            tokens = self.tokenizer.encode(prompt[: ROOT_MAX_CHARS], add_special_tokens=True)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            tokens = prompt
        else:
            return None
        return token_key(tokens[:COMPLETION_BLOCK])
