"""The model runner: turns a scheduled batch into a Step, runs the plan, hands sampled tokens back."""

from __future__ import annotations

import logging
from concurrent import futures

import numpy as np

from lse_core import structured
from lse_core.engine.sequence import Sequence
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
            out, starts = self._forward(batch)
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
                self._advance(seq, n, out, i, slice(starts[i], starts[i + 1]))
            except Exception as e:
                _fail(seq, e)

    def _forward(self, batch: list[tuple[Sequence, int]]) -> tuple[StepOutput, np.ndarray]:
        """The plan's output for the batch, and each sequence's first row in it."""
        seqs = [seq for seq, _ in batch]
        counts = np.array([n for _, n in batch], dtype=np.int32)
        starts = np.zeros(len(batch) + 1, dtype=np.int32)
        np.cumsum(counts, out=starts[1:])
        tokens = np.concatenate([np.asarray(s.tokens[s.computed: s.computed + n], dtype=np.int32)
                                 for s, n in batch])
        positions = np.concatenate([np.arange(s.computed, s.computed + n, dtype=np.int32) for s, n in batch])
        self.serial += 1
        rng_states = [s.rng.bit_generator.state for s in seqs]
        sampling = sampling_batch(batch)
        # masks only for constrained sequences sampled this step; computed while the plan runs
        constrained = [(s.params.constraint, i) for i, (s, n) in enumerate(batch)
                       if s.params.constraint is not None and s.params.constraint.active
                       and s.computed + n == len(s.tokens)]
        if constrained:
            structured.compute_masks(sampling, constrained)
        step = Step(tokens=tokens, positions=positions,
                    slots=np.array([s.slot for s in seqs], dtype=np.int32),
                    query_starts=starts, sample_rows=starts[1:] - 1, sampling=sampling, serial=self.serial)
        want_logits = any(s.params.top_logprobs is not None for s in seqs)
        want_hidden = any(s.params.on_hidden is not None for s in seqs)
        try:
            out = self.plan.run(step, want_logits, want_hidden)
        except Exception:   # a re-run draws the same numbers, so a seed still gives the same reply
            for seq, state in zip(seqs, rng_states):
                seq.rng.bit_generator.state = state
            raise
        finally:   # the matchers are advanced below: their masks must be done, even after a failed step
            if sampling.mask_job is not None:
                futures.wait([sampling.mask_job])
        for cause, mask in out.fallbacks:
            for seq in (s for s, hit in zip(seqs, mask) if hit):
                seq.fallbacks[cause] = seq.fallbacks.get(cause, 0) + 1
        return out, starts

    @staticmethod
    def _advance(seq: Sequence, n: int, out: StepOutput, i: int, rows: slice) -> None:
        """Take sequence ``i``'s part of a step's output: ``n`` more tokens computed (its hidden
        ``rows``), and a sampled token when the prompt is done."""
        if seq.params.on_hidden is not None:
            seq.params.on_hidden(out.hidden[rows])
        seq.computed += n
        if seq.computed < len(seq.tokens):      # prefill continues next step
            return
        token = seq.forced.pop(0) if seq.forced else int(out.next_tokens[i])
        top = seq.params.top_logprobs
        seq.append(token, token_logprobs(out.logits[i], token, top) if top is not None else None)


def _fail(seq: Sequence, e: Exception) -> None:
    if seq.finished:
        return
    if not isinstance(e, LSEError):
        log.error("lse: engine step failed", exc_info=e)
        e = server_error(f"engine step failed: {e!r}")
    seq.fail(e)


def sampling_batch(batch: list[tuple[Sequence, int]]) -> SamplingBatch:
    # A draw only for sequences sampled this step, so a seed gives the same reply however the
    # prompt was chunked or batched.
    uniform = [s.rng.random() if s.computed + n == len(s.tokens) else 0.0 for s, n in batch]
    return sampling_arrays([s.params.sampling for s, _ in batch], np.stack([s.recent() for s, _ in batch]),
                           np.array(uniform, dtype=np.float32))


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
