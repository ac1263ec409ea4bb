"""A prompt that cannot fit the context is refused before it is tokenized in full, and a template's
output is bounded by the same size, so a huge body costs neither seconds of tokenizer time nor memory
(issue 23 item 2). benchmarks/stall.py measures what a concurrent request waits meanwhile. Its error's
lse_context still counts the prompt's tokens (spec/API.md), read off windows of it that hold no more than the
bound's characters together (issue 49)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lse_core.api import LSE, lse_close, lse_embeddings, lse_open_or_raise, lse_request_iter, lse_tokenize
from lse_core.config import LSEConfig
from lse_core.errors import LSEError
from lse_core.limits import SAMPLE_WINDOWS

KV_LEN = 64
# one short message the template writes 20 000 times: a few hundred KB from a tiny body
# each message 2000 times: far past the 64-token prompt's bound, yet cheap enough that the template probe at
# load stays well inside its 2 s limit on a loaded machine (20000 copies took 2.15 s to load, idle)
EXPANDED_COPIES = 2000
EXPANDING_TEMPLATE = ("{% for message in messages %}{% for i in range(" + str(EXPANDED_COPIES) + ") %}"
                      "{{ message['content'] }}{% endfor %}{% endfor %}")


@pytest.fixture(scope="module")
def lse(tiny_checkpoint) -> Iterator[LSE]:
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    path = tiny_checkpoint("llama", chat_template=template)
    engine = lse_open_or_raise(LSEConfig(model=str(path), kv_len=KV_LEN, parallel=2, pool="cpu:0"))
    yield engine
    lse_close(engine)


@pytest.fixture
def encoded(lse: LSE, monkeypatch) -> list[int]:
    """The lengths of the texts the tokenizer encodes during the test."""
    lengths: list[int] = []
    encode = lse.model.tokenizer.encode

    def counting(text: str, add_special_tokens: bool) -> list[int]:
        lengths.append(len(text))
        return encode(text, add_special_tokens)

    monkeypatch.setattr(lse.model.tokenizer, "encode", counting)
    return lengths


def error_of(lse: LSE, body: dict, endpoint: str) -> dict:
    events = list(lse_request_iter(lse, body, endpoint))
    assert events[-1].kind == "error" and events[-1].status == 400, events[-1].data
    return events[-1].data["error"]


def test_the_bound_is_the_context_times_the_longest_token(lse: LSE) -> None:
    tokenizer = lse.model.tokenizer
    longest = max(len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size))
    shrink = 1 if tokenizer.backend.normalizer is None else 4
    assert tokenizer.longest_text(KV_LEN) == KV_LEN * longest * shrink


def sampled(bound: int) -> int:
    """The most characters the count of a refused prompt tokenizes: its windows hold the bound's characters, and
    each may end up to 64 characters later, at a space."""
    return bound + SAMPLE_WINDOWS * 64


def assert_counted(error: dict, exact: int) -> None:
    """lse_context counts the prompt, within 1% of its tokens (its size is read off a sample)."""
    context = error["lse_context"]
    assert abs(context["tokens_used"] - exact) <= exact // 100, (context, exact)
    assert (context["context_length"], context["tokens_remaining"]) == (KV_LEN, 0)


def test_a_completion_prompt_too_long_for_any_tokenization_is_not_tokenized(lse: LSE, encoded: list[int]) -> None:
    bound = lse.model.tokenizer.longest_text(KV_LEN)
    prompt = "Paris is the capital of France. " * (4 * bound // 32)
    error = error_of(lse, {"prompt": prompt, "max_tokens": 2}, "completion")
    assert error["code"] == "context_full" and error["param"] == "prompt"
    assert sum(encoded) <= sampled(bound) < len(prompt)
    assert_counted(error, len(lse.model.tokenizer.backend.encode(prompt).ids))   # with its special tokens
    encoded.clear()
    error = error_of(lse, {"prompt": "a" * bound, "max_tokens": 2}, "completion")   # at the bound: tokenized
    assert error["code"] == "context_full" and encoded == [bound]


def test_a_chat_message_too_long_is_refused_before_the_template_runs(lse: LSE, encoded: list[int], monkeypatch) -> None:
    rendered = []
    monkeypatch.setattr(lse.template, "render", lambda *a, **k: rendered.append(1))
    bound = lse.model.tokenizer.longest_text(KV_LEN)
    huge = "word " * (bound // 5 + 1)
    error = error_of(lse, {"messages": [{"role": "user", "content": huge}], "max_tokens": 2}, "chat")
    assert error["code"] == "context_full" and error["param"] == "messages"
    assert rendered == [] and sum(encoded) <= sampled(bound)
    assert_counted(error, len(lse.model.tokenizer.backend.encode(huge, add_special_tokens=False).ids))


def test_a_template_that_expands_a_message_is_stopped_at_the_bound(tiny_checkpoint, monkeypatch) -> None:
    path = tiny_checkpoint("llama", chat_template=EXPANDING_TEMPLATE)
    lse = lse_open_or_raise(LSEConfig(model=str(path), kv_len=KV_LEN, parallel=2, pool="cpu:0"))
    try:
        pieces: list[int] = []
        generate = lse.template._template.generate

        def counted(*args, **kwargs):
            for piece in generate(*args, **kwargs):
                pieces.append(len(piece))
                yield piece

        monkeypatch.setattr(lse.template._template, "generate", counted)
        error = error_of(lse, {"messages": [{"role": "user", "content": "0123456789"}], "max_tokens": 2}, "chat")
        assert error["code"] == "context_full"
        bound = lse.model.tokenizer.longest_text(KV_LEN)
        assert bound < sum(pieces) <= bound + 10 < EXPANDED_COPIES * 10   # it stopped as soon as it passed the bound
    finally:
        lse_close(lse)


def test_tokenize_and_embeddings_are_bounded_too(lse: LSE, encoded: list[int]) -> None:
    bound = lse.model.tokenizer.longest_text(KV_LEN)
    huge = "a" * (bound + 1)
    for call, body, param in [(lse_tokenize, {"prompt": huge}, "prompt"), (lse_tokenize, {"content": huge}, "content"),
                              (lse_embeddings, {"input": ["short", huge]}, "input[1]")]:
        encoded.clear()
        with pytest.raises(LSEError) as refused:
            call(lse, body)
        assert refused.value.code == "context_full" and refused.value.param == param
        assert sum(encoded) - len("short") * (param == "input[1]") <= sampled(bound)
        assert refused.value.extra["lse_context"]["tokens_used"] > KV_LEN


def test_a_prompt_that_fits_still_runs(lse: LSE) -> None:
    events = list(lse_request_iter(lse, {"prompt": "hello " * 10, "max_tokens": 3, "temperature": 0}, "completion"))
    assert events[-1].kind == "end" and events[-1].data["usage"]["completion_tokens"] == 3


def test_longest_text_counts_the_normalizer(tmp_path: Path) -> None:
    """A normalizer can shrink text before it is split, so the bound allows 4 bytes per byte of token."""
    from tokenizers import Tokenizer, models, normalizers

    from lse_core.model.tokenizer import Tokenizer as LSETokenizer

    backend = Tokenizer(models.WordLevel({"ab": 0, "abcd": 1, "[UNK]": 2}, unk_token="[UNK]"))
    plain = LSETokenizer(backend, eos_ids=())
    assert plain.max_token_bytes == 5 and plain.longest_text(10) == 50
    backend.normalizer = normalizers.NFKC()
    assert LSETokenizer(backend, eos_ids=()).longest_text(10) == 200
