"""The model runner: turns a scheduled batch into a Step, runs the plan, hands sampled tokens back."""

from __future__ import annotations

import logging
from concurrent import futures
from dataclasses import dataclass

import numpy as np

from lse_core import structured
from lse_core.engine.sequence import Sequence
from lse_core.engine.speculation import observe_acceptance
from lse_core.errors import LSEError, server_error
from lse_core.graph.ir import SamplingBatch, Step
from lse_core.graph.plan import Plan, StepOutput
from lse_core.sampling import SamplingParams, kernel_values

log = logging.getLogger("lse")


class Runner:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.serial = 0

    def run(self, batch: list[tuple[Sequence, int]]) -> None:
        """Run one step. A sequence whose step fails ends with the error; when a step of several
        sequences fails, each runs again alone, so only the ones that cause it fail (a re-run rewrites
        the same K/V rows, and no sequence changes before its forward pass succeeds)."""
        try:
            out, starts, sampled = self._forward(batch)
        except Exception as e:
            if len(batch) == 1:
                _fail(batch[0][0], e)
                return
            log.warning("lse: a step of %d sequences failed (%r); running each alone", len(batch), e)
            for one in batch:
                self.run([one])
            return
        for i, (seq, n) in enumerate(batch):
            try:
                self._advance(seq, n, out, slice(starts[i], starts[i + 1]),
                              slice(sampled.starts[i], sampled.starts[i + 1]), sampled.rng_after[i])
            except Exception as e:
                _fail(seq, e)

    def _forward(self, batch: list[tuple[Sequence, int]]) -> tuple[StepOutput, np.ndarray, SampledRows]:
        """The plan's output for the batch, each sequence's first row in it, and its sampled rows."""
        seqs = [seq for seq, _ in batch]
        # a decoding sequence's draft (lse_core.engine.speculation) rides as more rows of its chunk
        counts = np.array([n + len(s.draft) for s, n in batch], dtype=np.int32)
        starts = np.zeros(len(batch) + 1, dtype=np.int32)
        np.cumsum(counts, out=starts[1:])
        tokens = np.concatenate([np.asarray(s.tokens[s.computed: s.computed + n] + s.draft, dtype=np.int32)
                                 for s, n in batch])
        positions = np.concatenate([np.arange(s.computed, s.computed + n, dtype=np.int32)
                                    for s, n in zip(seqs, counts)])
        self.serial += 1
        rng_states = [s.rng.bit_generator.state for s in seqs]
        sampled = sampled_rows(batch, starts)
        # masks only for constrained sequences sampled this step (never drafted: one row each); computed
        # while the plan runs
        constrained = [(s.params.constraint, int(sampled.starts[i])) for i, (s, n) in enumerate(batch)
                       if s.params.constraint is not None and s.params.constraint.active
                       and s.computed + n == len(s.tokens)]
        if constrained:
            structured.compute_masks(sampled.sampling, constrained)
        step = Step(tokens=tokens, positions=positions,
                    slots=np.array([s.slot for s in seqs], dtype=np.int32),
                    query_starts=starts, sample_rows=sampled.rows, sampling=sampled.sampling, serial=self.serial)
        want_logits = any(s.params.top_logprobs is not None for s in seqs)
        want_hidden = any(s.params.on_hidden is not None for s in seqs)
        try:
            out = self.plan.run(step, want_logits, want_hidden)
        except Exception:   # a re-run draws the same numbers, so a seed still gives the same reply
            for seq, state in zip(seqs, rng_states):
                seq.rng.bit_generator.state = state
            raise
        finally:   # the matchers are advanced below: their masks must be done, even after a failed step
            if sampled.sampling.mask_job is not None:
                futures.wait([sampled.sampling.mask_job])
        # a fallback's mask has a flag per sequence, or per sampled row for the sampling ops
        row_seq = np.repeat(np.arange(len(seqs)), np.diff(sampled.starts))
        for cause, mask in out.fallbacks:
            hit = np.bincount(row_seq[mask], minlength=len(seqs)) > 0 if len(mask) == len(row_seq) else mask
            for seq in (s for s, h in zip(seqs, hit) if h):
                seq.fallbacks[cause] = seq.fallbacks.get(cause, 0) + 1
        return out, starts, sampled

    @staticmethod
    def _advance(seq: Sequence, n: int, out: StepOutput, rows: slice, samples: slice, rng_after: list[dict]) -> None:
        """Take a sequence's part of a step's output: ``n`` more tokens computed (its hidden ``rows``), and when
        the prompt is done, the token sampled from its first row of ``samples``; with a draft, while each
        sampled token equals the draft token that row checked, the next row's token too."""
        if seq.params.on_hidden is not None:
            seq.params.on_hidden(out.hidden[rows])
        seq.computed += n
        if seq.computed < len(seq.tokens):      # prefill continues next step
            return
        top = seq.params.top_logprobs
        if not seq.draft:
            token = seq.forced.pop(0) if seq.forced else int(out.next_tokens[samples.start])
            seq.append(token, token_logprobs(out.logits[samples.start], token, top) if top is not None else None)
            return
        draft = seq.draft   # the scheduler sets the next step's
        accepted = 0
        for row in range(samples.start, samples.stop):
            token = int(out.next_tokens[row])
            seq.append(token, token_logprobs(out.logits[row], token, top) if top is not None else None)
            if seq.finished or seq.forced or accepted == len(draft) or token != draft[accepted]:
                break
            accepted += 1
        observe_acceptance(seq, len(draft), accepted)
        # the rows past the kept tokens were written for rejected tokens: the cache's length shrinks back (their
        # K/V stay until overwritten, never read: attention reads only positions before a query's own)
        seq.computed = len(seq.tokens) - 1
        # each row drew one number: the generator continues after the rows used, as if it had drawn only those
        seq.rng.bit_generator.state = rng_after[row - samples.start]


def _fail(seq: Sequence, e: Exception) -> None:
    if seq.finished:
        return
    if not isinstance(e, LSEError):
        log.error("lse: engine step failed", exc_info=e)
        e = server_error(f"engine step failed: {e!r}")
    seq.fail(e)


@dataclass
class SampledRows:
    """A step's sampled rows: one per sequence, and one more per draft token. Sequence i's are
    ``rows[starts[i]:starts[i + 1]]``; ``rng_after[i][j]`` is its generator's state after its row j's draw."""

    rows: np.ndarray
    starts: np.ndarray
    sampling: SamplingBatch
    rng_after: list[list[dict]]


def sampled_rows(batch: list[tuple[Sequence, int]], starts: np.ndarray) -> SampledRows:
    # A draw only for sequences sampled this step, so a seed gives the same reply however the
    # prompt was chunked or batched; with a draft, a draw per row, in the reply's order.
    rows, params, recent, uniform, rng_after = [], [], [], [], []
    for (s, n), end in zip(batch, starts[1:]):
        first = end - len(s.draft) - 1
        rows.extend(range(first, end))
        params.extend([s.params.sampling] * (len(s.draft) + 1))
        recent.extend(s.recent(s.draft[:j]) for j in range(len(s.draft) + 1))
        states = []
        for _ in range(len(s.draft) + 1):
            uniform.append(s.rng.random() if s.computed + n == len(s.tokens) else 0.0)
            states.append(s.rng.bit_generator.state if s.draft else {})
        rng_after.append(states)
    counts = [len(states) for states in rng_after]
    return SampledRows(np.array(rows, dtype=np.int32), np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
                       sampling_arrays(params, np.stack(recent), np.array(uniform, dtype=np.float32)), rng_after)


def sampling_arrays(requested: list[SamplingParams], recent: np.ndarray, uniform: np.ndarray) -> SamplingBatch:
    p = [kernel_values(x) for x in requested]
    return SamplingBatch(
        temperature=np.array([x.temperature for x in p], dtype=np.float32),
        top_k=np.array([x.top_k for x in p], dtype=np.int32),
        top_p=np.array([x.top_p for x in p], dtype=np.float32),
        min_p=np.array([x.min_p for x in p], dtype=np.float32),
        repetition_penalty=np.array([x.repetition_penalty for x in p], dtype=np.float32),
        presence_penalty=np.array([x.presence_penalty for x in p], dtype=np.float32),
        recent=recent,
        uniform=uniform,
    )


def token_logprobs(logits: np.ndarray, token: int, top: int) -> dict:
    """The model's log-probabilities (before sampling transforms) of the token and the ``top`` best."""
    shifted = logits.astype(np.float64) - logits.max()
    logp = shifted - np.log(np.exp(shifted).sum())
    best = np.argsort(-logp, kind="stable")[:top] if top else np.empty(0, dtype=np.int64)
    return {"token": token, "logprob": float(logp[token]),
            "top": [(int(t), float(logp[t])) for t in best]}
