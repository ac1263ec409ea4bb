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
# Decoding sequences in a step above which none speculates: with that many rows the step is no longer bound by
# reading the weights once, so rows that may be rejected cost what they could save.
MAX_SPECULATING_DECODES = 8
# How much a verification's acceptance counts against a sequence's earlier ones (its moving average).
ACCEPTANCE_WEIGHT = 0.5


@dataclass(frozen=True)
class Speculation:
    """How the engine speculates: ``draft_max`` tokens proposed per step at most, none when fewer than
    ``draft_min`` would be."""

    draft_max: int
    draft_min: int = 0

    def propose(self, seq: Sequence, room: int) -> list[int]:
        """The tokens proposed to follow ``seq`` this step, at most ``room`` of them; fewer the lower its
        recent acceptance, so a sequence whose proposals fail costs few rows (it still probes with one)."""
        limit = min(room, max(1, round(self.draft_max * seq.acceptance)), self.draft_max)
        if limit < max(self.draft_min, 1):
            return []
        proposal = ngram_proposal(np.asarray(seq.tokens, dtype=np.int32), limit)
        return proposal if len(proposal) >= self.draft_min else []


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
    """Count one verification in the sequence's totals and its moving acceptance rate."""
    seq.draft_n += proposed
    seq.draft_n_accepted += accepted
    seq.acceptance += ACCEPTANCE_WEIGHT * (accepted / proposed - seq.acceptance)
