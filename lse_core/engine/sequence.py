"""One request's sequence: its tokens, sampling state, and the text it has produced so far
(incremental detokenization, stop strings held back across token boundaries, reasoning split)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from lse_core.graph.ir import PENALTY_WINDOW
from lse_core.sampling import NEUTRAL_SAMPLING, SamplingParams


class Splitter(Protocol):
    inside: bool     # the reply is inside the reasoning block

    def feed(self, text: str) -> tuple[str, str]: ...
    def finish(self) -> tuple[str, str]: ...


class Constraint(Protocol):
    """lse_core.structured.Constraint: ``active`` when this step's token is masked; ``advance`` takes the
    sampled token and says whether the grammar is complete."""
    active: bool
    def advance(self, token: int) -> bool: ...


@dataclass(frozen=True)
class ReasoningBudget:
    """At most ``tokens`` reply tokens inside the reasoning block; then the engine appends ``close_ids`` (the
    template's end marker) instead of sampling, and the answer follows."""

    tokens: int
    close_ids: tuple[int, ...]


@dataclass
class SeqParams:
    """What the engine needs to run a request (filled by lse_core.api)."""

    prompt: list[int]
    max_new_tokens: int
    limit_reason: str                          # stop_reason when max_new_tokens is reached
    sampling: SamplingParams = NEUTRAL_SAMPLING
    stop: list[str] = field(default_factory=list)
    eos_ids: tuple[int, ...] = ()
    top_logprobs: int | None = None            # None: no logprobs; n >= 0: the token's and n top ones
    splitter: Splitter | None = None
    skip_special_tokens: bool = True           # False keeps markers a tool-call parser reads
    reasoning_budget: ReasoningBudget | None = None
    # embeddings: takes the final hidden rows of each prompt chunk computed (with max_new_tokens 0, no reply)
    on_hidden: Callable[[np.ndarray], None] | None = None
    constraint: Constraint | None = None       # structured output: the grammar the reply follows
    speculative: bool = True                   # False: the engine never proposes tokens for it


@dataclass
class Delta:
    """What one step added to a sequence's reply."""

    content: str = ""
    reasoning: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)


class Sequence:
    def __init__(self, params: SeqParams, on_delta: Callable[[Sequence, Delta], None],
                 on_finish: Callable[[Sequence], None], detokenizer: Any, vocab: Any) -> None:
        self.params = params
        self.on_delta = on_delta
        self.on_finish = on_finish
        self.output: list[int] = []
        self.slot = -1
        self.cached = 0            # prompt tokens whose K/V the slot already held
        self.computed = 0          # tokens whose K/V are in the cache
        self.cancelled = False
        self.paused = False        # its consumer is behind: the scheduler skips it until resumed
        self.abort_error: Exception | None = None
        self.finish_reason: str | None = None   # "stop" or "length"
        self.stop_reason: str | None = None     # the spec's stop_reason; set when the sequence ends
        self.fallbacks: dict[str, int] = {}   # fallback cause -> steps of this sequence it ran in
        self.error: Exception | None = None
        self.rng = np.random.default_rng(params.sampling.seed)
        self.t_submit = time.perf_counter()
        self.t_admit = self.t_submit      # when it got a KV slot
        self.t_first_token: float | None = None
        self.t_end: float | None = None
        self._detok = detokenizer
        self._vocab = vocab
        self._pending = ""         # decoded text not yet released (may be the start of a stop string)
        self._decoded = ""         # everything the incremental detokenizer has returned
        self.forced: list[int] = []   # tokens the engine appends next instead of sampling (the reasoning's end)
        self.reasoning_tokens = 0     # reply tokens written inside the reasoning block, its end marker included
        self.stop_string: str | None = None   # the stop string that ended the reply
        self.draft: list[int] = []    # tokens proposed this step, checked as extra rows after the last token
        self.draft_n = 0              # tokens proposed over the reply, and how many of them it kept
        self.draft_n_accepted = 0
        self.draft_hits = 0.0         # decaying counts of proposed tokens kept and rejected (speculation.py)
        self.draft_misses = 0.0

    @property
    def tokens(self) -> list[int]:
        return self.params.prompt + self.output

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.params.prompt)

    @property
    def finished(self) -> bool:
        return self.stop_reason is not None

    def recent(self, then: list[int] | None = None) -> np.ndarray:
        """The last PENALTY_WINDOW tokens (with ``then`` after them, when given), -1 padded."""
        window = (self.tokens + (then or []))[-PENALTY_WINDOW:]
        out = np.full(PENALTY_WINDOW, -1, dtype=np.int32)
        out[: len(window)] = window
        return out

    def append(self, token: int, logprobs: dict[str, Any] | None) -> None:
        """Take a sampled token: end at eos, or release new text up to any stop string."""
        if self.t_first_token is None:
            self.t_first_token = time.perf_counter()
        self.output.append(token)
        delta = Delta(token_ids=[token], logprobs=[logprobs] if logprobs else [])
        if token in self.params.eos_ids:
            self._end(delta, "stop", "stop_token")
            return
        try:
            grammar_complete = self.params.constraint is not None and self.params.constraint.advance(token)
        except RuntimeError as e:   # llguidance gave up on this sequence alone
            self.fail(e)
            return
        piece = self._detok.step(self._vocab, token) or ""
        self._decoded += piece
        self._pending += piece
        found = _find_stop(self._pending, self.params.stop)
        if found is not None:
            cut, self.stop_string = found
            self._pending = self._pending[:cut]
            self._end(delta, "stop", "stop_sequence")
            return
        if grammar_complete:    # nothing but an end of turn could follow: end here, as if it had come
            self._end(delta, "stop", "stop_token")
            return
        if len(self.output) >= self.params.max_new_tokens:
            self._end(delta, "length", self.params.limit_reason)
            return
        inside = self.params.splitter is not None and self.params.splitter.inside
        keep = len(self._pending) - _stop_prefix_len(self._pending, self.params.stop)
        self._release(delta, self._pending[:keep])
        self._pending = self._pending[keep:]
        if inside:
            self.reasoning_tokens += 1
            self._spend_reasoning()
        self.on_delta(self, delta)

    def _spend_reasoning(self) -> None:
        """At the reasoning budget, queue the block's end marker."""
        budget = self.params.reasoning_budget
        if budget is not None and self.reasoning_tokens == budget.tokens:
            self.forced = list(budget.close_ids)

    def cancel(self, error: Exception | None = None) -> None:
        """End at the next step boundary: cancelled (client gone or request cancelled), or failed with
        ``error`` (the server shutting down)."""
        self.cancelled = True
        self.abort_error = self.abort_error or error

    def fail(self, error: Exception) -> None:
        """End with an error (the API turns it into an error event)."""
        self.error = error
        self.stop_reason = "error"
        self.t_end = time.perf_counter()
        self.on_finish(self)

    def end_cancelled(self) -> None:
        if self.abort_error is not None:
            self.fail(self.abort_error)
        else:
            self._end(Delta(), None, "cancelled")

    def _release(self, delta: Delta, text: str) -> None:
        if self.params.splitter is None:
            delta.content += text
        else:
            reasoning, content = self.params.splitter.feed(text)
            delta.reasoning += reasoning
            delta.content += content

    def _end(self, delta: Delta, finish_reason: str | None, stop_reason: str) -> None:
        """Release what was held back (no stop string can follow any more) and finish."""
        if stop_reason != "stop_sequence":
            self._pending += self._unfinished_tail()
        self._release(delta, self._pending)
        self._pending = ""
        if self.params.splitter is not None:
            reasoning, content = self.params.splitter.finish()
            delta.reasoning += reasoning
            delta.content += content
        self.finish_reason = finish_reason    # None when cancelled: the spec gives it no finish_reason
        self.stop_reason = stop_reason
        self.t_end = time.perf_counter()
        if delta.content or delta.reasoning or delta.token_ids:
            self.on_delta(self, delta)
        self.on_finish(self)

    def _unfinished_tail(self) -> str:
        """Text the incremental detokenizer still holds back (an incomplete UTF-8 character at the
        end of the reply), decoded the way a whole-reply decode would show it."""
        ids = [t for t in self.output if t not in self.params.eos_ids]
        whole = self._vocab.decode(ids, skip_special_tokens=self.params.skip_special_tokens)
        return whole[len(self._decoded):] if whole.startswith(self._decoded) else ""


def _find_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Where the earliest stop string starts in ``text``, and which one it is."""
    hits = [(i, s) for i, s in ((text.find(s), s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
