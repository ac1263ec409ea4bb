"""Speculative decoding: proposals the target model checks in its ordinary step.

A decoding sequence's proposed tokens ride as extra rows of its chunk in the step; each row's logits are
sampled with the sequence's own parameters, and the reply takes the sampled tokens while each one equals the
proposal it checks (the first that differs is the model's own token, and a full run of matches ends with one
more). For a deterministic proposal this is the standard rejection rule: token t is kept with probability
p(t), and otherwise the token drawn is one from p with t removed, renormalised; so greedy replies are token
for token those without speculation, and sampled ones follow the same distribution.

The ngram proposer is prompt lookup: the sequence's last n tokens (n from NGRAM_MAX down to NGRAM_MIN), found
at their latest earlier place in its prompt and reply, propose the tokens that followed them there."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from lse_core.engine.sequence import Sequence

NGRAM_MAX = 4   # the longest n-gram looked up: a longer match predicts better, and is tried first
NGRAM_MIN = 2   # a single token recurs too often to predict what follows it
# Decoding sequences in a step above which none speculates: with that many rows the step is bound by arithmetic,
# not by reading the weights once, so rows that may be rejected cost what they could save.
MAX_SPECULATING_DECODES = 8
# What each new verification (or step that declined to propose) keeps of a sequence's earlier acceptance counts:
# the estimate follows the reply's change from copying to writing within a few steps, and a sequence whose
# proposals failed drifts back to the even prior, so it probes again.
KEEP = 0.8
# How much each step's measurement counts against the older ones in DraftCost's fit.
FORGET = 0.2


class DraftCost:
    """An online estimate of a step of decodes (no prompt chunks): ``decode_s`` plus ``per_row`` for each draft row,
    fitted by least squares over the latest such steps, older ones counting less. Until steps with different
    draft rows have been measured, ``per_row`` stays 0 (every proposal looks free, so they come and get measured)."""

    def __init__(self) -> None:
        self.decode_s = 0.0
        self.per_row = 0.0
        self._gram = np.zeros((2, 2))    # weighted sums of x x^T and x y, x = (1, draft rows)
        self._moment = np.zeros(2)

    def observe(self, draft_rows: int, seconds: float) -> None:
        x = np.array([1.0, draft_rows])
        self._gram = (1 - FORGET) * self._gram + np.outer(x, x)
        self._moment = (1 - FORGET) * self._moment + x * seconds
        det = self._gram[0, 0] * self._gram[1, 1] - self._gram[0, 1] ** 2
        if det > 1e-6 * self._gram[0, 0] * self._gram[1, 1]:
            decode_s, per_row = np.linalg.solve(self._gram, self._moment)
            self.decode_s, self.per_row = max(float(decode_s), 0.0), max(float(per_row), 0.0)
        else:   # every step had the same rows: they tell the total alone
            self.decode_s = max(float(self._moment[0] / self._gram[0, 0]) - self.per_row * draft_rows, 0.0)


@dataclass(frozen=True)
class Speculation:
    """How the engine speculates: ``draft_max`` tokens proposed per step at most, none when fewer than
    ``draft_min`` would be."""

    draft_max: int
    draft_min: int = 0

    def propose(self, seq: Sequence, room: int, cost: DraftCost, step_s: float, step_tokens: float) -> list[int]:
        """The tokens proposed to follow ``seq`` this step, at most ``room``: the length of the proposal's prefix
        that makes the most tokens per second of a step already costing ``step_s`` for ``step_tokens`` expected
        tokens, each proposed token kept with the sequence's estimated acceptance (after all those before it)."""
        proposal = ngram_proposal(np.asarray(seq.tokens, dtype=np.int32), min(room, self.draft_max))
        alpha = (seq.draft_hits + 1) / (seq.draft_hits + seq.draft_misses + 2)
        best, best_rate, expected, kept = 0, step_tokens + 1, step_tokens + 1, 1.0
        for k in range(1, len(proposal) + 1):
            kept *= alpha
            expected += kept
            # rates relative to the step without drafts: tokens over (seconds / step_s)
            rate = expected / (1 + k * cost.per_row / step_s) if step_s > 0 else expected
            if rate > best_rate:
                best, best_rate = k, rate
        if best < max(self.draft_min, 1):
            if proposal:    # declined: the counts fade towards the prior, so the sequence proposes again
                seq.draft_hits *= KEEP
                seq.draft_misses *= KEEP
            return []
        return proposal[:best]


def ngram_proposal(tokens: np.ndarray, limit: int) -> list[int]:
    """Up to ``limit`` tokens that followed the latest earlier occurrence of the longest suffix n-gram."""
    for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
        if len(tokens) <= n:
            continue
        # windows start at 0 .. len - n - 1: each is followed by at least one token, and none is the suffix itself
        windows = sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start: start + limit].tolist()
    return []


def observe_acceptance(seq: Sequence, proposed: int, accepted: int) -> None:
    """Count one verification: the reply's totals, and the decaying counts of kept tokens (hits) and of the
    rejections (misses: one when a proposed token was not kept) that estimate the acceptance of the next."""
    seq.draft_n += proposed
    seq.draft_n_accepted += accepted
    seq.draft_hits = KEEP * seq.draft_hits + accepted
    seq.draft_misses = KEEP * seq.draft_misses + (accepted < proposed)
