"""Prefix-affinity keys and the replica choice, without Ray: a conversation's turns share a key, other
conversations (mostly) do not, the key is the same whichever API the conversation comes through, and the
choice is a consistent hash bounded by load."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from lse_ray.affinity import COMPLETION_BLOCK, PromptKeys, bounded_choice, rendezvous_order

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def keys(tiny_checkpoint) -> PromptKeys:
    return PromptKeys(str(tiny_checkpoint("qwen3", chat_template=CHAT_TEMPLATE)))


def chat(messages: list[dict], **fields) -> bytes:
    return json.dumps({"messages": messages, **fields}).encode()


def test_a_conversations_turns_share_its_key(keys: PromptKeys) -> None:
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    later = first + [{"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}]
    key = keys.key("/v1/chat/completions", chat(first))
    assert key is not None
    assert keys.key("/v1/chat/completions", chat(later, stream=True, max_tokens=9)) == key
    assert keys.key("/v1/chat/completions", chat([first[0], {"role": "user", "content": "Name a fruit."}])) != key
    assert keys.key("/v1/chat/completions", chat(first[1:])) != key   # another system prompt: another prefix


def test_the_apis_key_a_conversation_alike(keys: PromptKeys) -> None:
    question = [{"role": "user", "content": "Name a colour."}]
    key = keys.key("/v1/chat/completions", chat(question))
    messages = {"model": "tiny", "messages": question, "max_tokens": 8}
    assert keys.key("/v1/messages", json.dumps(messages).encode()) == key
    assert keys.key("/v1/responses", json.dumps({"input": "Name a colour."}).encode()) == key


def test_a_completion_is_keyed_by_its_leading_block(keys: PromptKeys) -> None:
    tokens = list(range(3, 3 + COMPLETION_BLOCK))
    key = keys.key("/v1/completions", json.dumps({"prompt": tokens}).encode())
    assert keys.key("/v1/completions", json.dumps({"prompt": tokens + [5, 6]}).encode()) == key
    assert keys.key("/v1/completions", json.dumps({"prompt": [4] + tokens[1:]}).encode()) != key


def test_bodies_without_a_prompt_have_no_key(keys: PromptKeys) -> None:
    for path, body in [("/v1/chat/completions", b"{not json"), ("/v1/chat/completions", b"[1, 2]"),
                       ("/v1/chat/completions", chat([{"role": "system", "content": "no user turn"}])),
                       ("/v1/messages", b'{"messages": 3}'), ("/v1/embeddings", b'{"input": "hi"}'),
                       ("/v1/completions", b'{"prompt": {"a": 1}}')]:
        assert keys.key(path, body) is None, (path, body)


def test_rendezvous_order_is_a_consistent_hash() -> None:
    replicas = ["a", "b", "c", "d"]
    first = {key: rendezvous_order(key, replicas)[0] for key in range(2000)}
    assert all(count > 350 for count in Counter(first.values()).values())   # about 500 each
    without_c = {key: rendezvous_order(key, ["a", "b", "d"])[0] for key in range(2000)}
    assert all(without_c[key] == first[key] for key in first if first[key] != "c")   # only c's keys move


def test_a_long_queue_passes_a_key_to_its_next_replica() -> None:
    key = 12345
    preferred, second = rendezvous_order(key, ["a", "b", "c"])[:2]
    assert bounded_choice(key, {"a": 0, "b": 0, "c": 0}) == preferred
    assert bounded_choice(key, {"a": 1, "b": 1, "c": 1} | {preferred: 2}) == preferred   # within 1.5x the mean
    assert bounded_choice(key, {"a": 0, "b": 0, "c": 0} | {preferred: 6}) == second
