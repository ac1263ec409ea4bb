"""Continuous batching: sequences wait in a bounded queue for a KV slot; each step takes one
token from every decoding sequence and a chunk of prompt from those still prefilling.

Fair steps: while sequences decode, every step delays each of their next tokens by its whole duration, so
the prompt chunks in a step are bounded by time, not by a token count alone. StepCost estimates, from the
steps already run, what a step of decodes costs and what a prompt chunk adds to it; the scheduler takes as
many prompt tokens as fit in the step time target. With nothing decoding, a prompt takes its large
efficient chunks (prefill_chunk tokens)."""

from __future__ import annotations

import math
import time
from collections import deque

import numpy as np

from lse_core.engine.kv_slots import KVSlots
from lse_core.engine.sequence import Sequence
from lse_core.engine.speculation import MAX_SPECULATING_DECODES, DraftCost, Speculation
from lse_core.errors import server_error

# What a step with decodes may take, in seconds: the gap a running stream sees between two tokens is about one
# step, and the estimate can be off by a step's noise, so this stays well under the 0.5 s a stream may wait.
STEP_TARGET_S = 0.3
# Prompt tokens a step with decodes takes at least, even when the estimate says none fit: the prompt still
# advances, and its steps keep measuring what a chunk costs.
MIN_PREFILL_CHUNK = 16
# How much each new step's measurement counts against the older ones (1 - FORGET of the weight stays with them):
# the estimate follows a change of load or context within a few steps.
FORGET = 0.2

Batch = list[tuple[Sequence, int]]


class StepCost:
    """An online estimate of a step's seconds. A step of decodes alone costs ``decode_s`` (an average of the
    latest such steps). A prompt chunk of n tokens from context position s adds
    ``n * per_token + positions * per_position`` where ``positions`` sums s..s+n-1: the linear layers cost the
    same per token, attention reads every earlier position. Both are fitted by least squares over the latest
    steps with prompt chunks, older steps counting less. A fit from small chunks is mostly noise, so it is
    trusted for at most twice the most prompt tokens a measured step had (``measured_tokens``)."""

    def __init__(self) -> None:
        self.decode_s = 0.0
        self.measured_tokens = 0
        self.per_token = 0.0
        self.per_position = 0.0
        self._gram = np.zeros((2, 2))    # the fit's weighted sums of x x^T and x y, x = (tokens, positions)
        self._moment = np.zeros(2)

    @property
    def known(self) -> bool:
        """Whether measured steps have put a cost on prompt chunks."""
        return self.per_token > 0 or self.per_position > 0

    def prefill_s(self, n: int, start: int) -> float:
        """The estimated seconds n prompt tokens from context position ``start`` add to a step."""
        return n * self.per_token + _positions(n, start) * self.per_position

    def tokens_within(self, seconds: float, start: int) -> int:
        """The most prompt tokens from position ``start`` whose prefill_s is at most ``seconds`` (once ``known``):
        the root of (per_position/2) n^2 + (per_token + per_position (start - 1/2)) n = seconds."""
        if seconds <= 0:
            return 0
        linear = self.per_token + self.per_position * (start - 0.5)
        quadratic = self.per_position / 2
        if quadratic == 0:
            return math.floor(seconds / linear)
        return math.floor((math.sqrt(linear * linear + 4 * quadratic * seconds) - linear) / (2 * quadratic))

    def observe(self, decodes: int, chunks: list[tuple[int, int]], seconds: float) -> None:
        """Take a step's measured time: ``decodes`` sequences decoded a token and ``chunks`` are the
        (start position, tokens) of its prompt chunks."""
        if not chunks:
            if decodes:
                self.decode_s = seconds if self.decode_s == 0 else self.decode_s + FORGET * (seconds - self.decode_s)
            return
        x = np.array([sum(n for _, n in chunks), sum(_positions(n, s) for s, n in chunks)], dtype=np.float64)
        self.measured_tokens = max(self.measured_tokens, int(x[0]))
        prefill = max(seconds - (self.decode_s if decodes else 0.0), 0.0)
        self._gram = (1 - FORGET) * self._gram + np.outer(x, x)
        self._moment = (1 - FORGET) * self._moment + x * prefill
        self.per_token, self.per_position = _nonnegative_fit(self._gram, self._moment)


def _positions(n: int, start: int) -> int:
    """The sum of the context positions start .. start+n-1."""
    return n * start + n * (n - 1) // 2


def _nonnegative_fit(gram: np.ndarray, moment: np.ndarray) -> tuple[float, float]:
    """Least squares with both coefficients at least 0: the two-term solution when it is nonnegative and
    determined, else the better of the one-term ones (one step, or steps all at one context, cannot tell
    the terms apart)."""
    det = gram[0, 0] * gram[1, 1] - gram[0, 1] ** 2
    if det > 1e-9 * gram[0, 0] * gram[1, 1]:
        both = np.linalg.solve(gram, moment)
        if (both >= 0).all():
            return float(both[0]), float(both[1])
    # each one-term fit's residual sum of squares is sum(y^2) - moment_i^2 / gram_ii: the larger quotient wins
    singles = [moment[i] / gram[i, i] if gram[i, i] > 0 else 0.0 for i in range(2)]
    gains = [moment[i] * singles[i] for i in range(2)]
    best = int(np.argmax(gains))
    fit = [0.0, 0.0]
    fit[best] = max(float(singles[best]), 0.0)
    return fit[0], fit[1]


class Scheduler:
    def __init__(self, n_slots: int, max_queue: int, prefill_chunk: int, step_target_s: float = STEP_TARGET_S,
                 cost: StepCost | None = None, speculation: Speculation | None = None) -> None:
        self.slots = KVSlots(n_slots)
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self.step_target_s = step_target_s
        self.cost = cost or StepCost()
        self.speculation = speculation
        self.draft_cost = DraftCost()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        """Whether a step would do something: a sequence to decode, admit or end (a paused one waits)."""
        return (any(s.cancelled for s in self.waiting) or bool(self.waiting and self.slots.n_free)
                or any(s.cancelled or not s.paused for s in self.running))

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.max_queue:
            raise server_error(f"the server is busy: {len(self.running)} sequences are running and "
                               f"{len(self.waiting)} requests are waiting; retry later",
                               code="overloaded", status=503)
        self.waiting.append(seq)

    def schedule(self) -> Batch:
        """This step's batch: (sequence, tokens to compute). Cancelled sequences end here."""
        for seq in [s for s in self.waiting if s.cancelled]:
            self.waiting.remove(seq)
            seq.end_cancelled()
        for seq in [s for s in self.running if s.cancelled]:
            self.release(seq)
            seq.end_cancelled()
        while self.waiting and self.slots.n_free:
            seq = self.waiting.popleft()
            seq.slot, seq.cached = self.slots.acquire(seq.params.prompt)
            if seq.params.on_hidden is not None:   # embeddings pool every row: none may come from the cache
                seq.cached = 0
            seq.computed = seq.cached
            seq.t_admit = time.perf_counter()
            self.running.append(seq)
        # a paused sequence's client is not reading: it keeps its slot and its place, and computes nothing
        active = [s for s in self.running if not s.paused]
        decoding = any(len(s.tokens) - s.computed == 1 for s in active)
        tokens_left = self.prefill_chunk
        if decoding:
            tokens_left = min(tokens_left, max(2 * self.cost.measured_tokens, MIN_PREFILL_CHUNK))
        seconds_left = self.step_target_s - self.cost.decode_s   # what prompt chunks may add to a step of decodes
        chunked = False
        batch = []
        for seq in active:
            remaining = len(seq.tokens) - seq.computed
            if remaining == 1:
                batch.append((seq, 1))
                continue
            n = min(remaining, tokens_left)
            if decoding:   # until a chunk is measured, none fits; the step's first chunk always advances
                fits = self.cost.tokens_within(seconds_left, seq.computed) if self.cost.known else 0
                n = min(n, fits if chunked else max(fits, MIN_PREFILL_CHUNK))
                seconds_left -= self.cost.prefill_s(n, seq.computed)
            if n > 0:
                tokens_left -= n
                chunked = True
                batch.append((seq, n))
        self._propose(batch, tokens_left)
        return batch

    def _propose(self, batch: Batch, rows_left: int) -> None:
        """Set each decoding sequence's draft for this step (lse_core.engine.speculation), within the rows the
        step has left. None when many sequences decode: their step is bound by arithmetic, not weight reads."""
        decoding = [seq for seq, n in batch if len(seq.tokens) - seq.computed == n == 1]
        for seq in decoding:
            seq.draft = []
        if self.speculation is None or len(decoding) > MAX_SPECULATING_DECODES:
            return
        step_s, step_tokens = self.draft_cost.decode_s, len(decoding) - 1   # the others' tokens: each proposes after
        for seq in decoding:
            params = seq.params
            if not params.speculative or params.constraint is not None or seq.forced or rows_left <= 0:
                step_tokens += 1
                continue
            # the reply's last token comes from the step's final row: no proposal past max_new_tokens, and
            # so none past the context (the engine admits no prompt + max_new_tokens beyond it)
            room = min(rows_left, params.max_new_tokens - len(seq.output) - 1)
            if room > 0:
                seq.draft = self.speculation.propose(seq, room, self.draft_cost, step_s, step_tokens)
            rows_left -= len(seq.draft)
            step_s += len(seq.draft) * self.draft_cost.per_row
            step_tokens += 1 + len(seq.draft) / 2   # a rough share kept, for the next sequence's choice

    def observe(self, batch: Batch, starts: list[int], seconds: float) -> None:
        """Take a step's measured time; ``starts`` are its sequences' context positions before it ran. Its
        proposed tokens' rows are costed apart (DraftCost), and left out of what the decodes cost."""
        draft_rows = sum(len(seq.draft) for seq, _ in batch)
        chunks = [(start, n) for (_, n), start in zip(batch, starts) if n > 1]
        if not chunks:
            self.draft_cost.observe(draft_rows, seconds)
        self.cost.observe(sum(n == 1 for _, n in batch), chunks, seconds - draft_rows * self.draft_cost.per_row)

    def release(self, seq: Sequence) -> None:
        """Free the sequence's slot, remembering the tokens its cache now holds."""
        if seq in self.running:
            self.running.remove(seq)
            self.slots.release(seq.slot, seq.tokens[: seq.computed])
