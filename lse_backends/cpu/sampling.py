"""numpy kernels for the sampling ops of lse_core.graph.ir, on logits [S, vocab].

Each op copies its input and changes only the rows whose sequence needs it
(``SAMPLING_OP_NEEDED``); ``sample`` turns the rows into token ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from lse_core.devices.hookspec import CompileContext
from lse_core.graph.ir import SAMPLING_OP_NEEDED, Node, SamplingBatch, Step

from .kernels import NodeKernel, OutputBuffer

NEG_INF = np.float32(-np.inf)


def _softmax(row: np.ndarray) -> np.ndarray:
    e = np.exp(row - row.max())
    return e / e.sum()


def _mask(row: np.ndarray, s: SamplingBatch, i: int) -> None:
    allowed = np.unpackbits(s.token_mask[i].view(np.uint8), bitorder="little")[:len(row)]
    row[allowed == 0] = NEG_INF


def _penalize(row: np.ndarray, s: SamplingBatch, i: int) -> None:
    recent = s.recent[i]
    seen = np.unique(recent[(recent >= 0) & (recent < len(row))])
    logits = row[seen]
    penalty = s.repetition_penalty[i]
    if penalty != 1:
        logits = np.where(logits > 0, logits / penalty, logits * penalty)
    row[seen] = logits - s.presence_penalty[i]


def _temperature(row: np.ndarray, s: SamplingBatch, i: int) -> None:
    row /= s.temperature[i]


def _top_k(row: np.ndarray, s: SamplingBatch, i: int) -> None:
    k = int(s.top_k[i])
    if k < len(row):
        kth = np.partition(row, len(row) - k)[len(row) - k]
        row[row < kth] = NEG_INF  # ties at the k-th value stay


def _top_p(row: np.ndarray, s: SamplingBatch, i: int) -> None:
    probs = _softmax(row)
    order = np.argsort(-probs, kind="stable")
    reached = np.searchsorted(np.cumsum(probs[order]), s.top_p[i], side="left")
    row[order[reached + 1:]] = NEG_INF  # the prefix up to the token whose mass reaches top_p stays


def _min_p(row: np.ndarray, s: SamplingBatch, i: int) -> None:
    probs = _softmax(row)
    row[probs < s.min_p[i] * probs.max()] = NEG_INF


def _row_op(op: str, apply: Callable[[np.ndarray, SamplingBatch, int], None]):
    """A factory for a logits processor that rewrites, in a copy, the rows that need ``op``."""

    def factory(node: Node, params: list[np.ndarray], ctx: CompileContext) -> NodeKernel:
        buffer = OutputBuffer(ctx.kv_slots)

        def run(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
            (logits,) = inputs
            out = buffer.take(*logits.shape)
            np.copyto(out, logits)
            if step.sampling is not None:
                for i in np.flatnonzero(SAMPLING_OP_NEEDED[op](step.sampling)):
                    apply(out[i], step.sampling, int(i))
            return out

        return run

    return factory


def sample(node: Node, params: list[np.ndarray], ctx: CompileContext) -> NodeKernel:
    def run(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
        (logits,) = inputs
        tokens = np.argmax(logits, axis=1).astype(np.int32)  # lowest id on ties
        s = step.sampling
        if s is not None:
            for i in np.flatnonzero(s.temperature > 0):
                row = logits[i]
                cumulative = np.cumsum(np.exp(row - row.max()))
                drawn = np.searchsorted(cumulative, s.uniform[i] * cumulative[-1], side="right")
                tokens[i] = min(int(drawn), len(row) - 1)
        return tokens

    return run


SAMPLING_KERNELS = {
    "mask": _row_op("mask", _mask),
    "penalize": _row_op("penalize", _penalize),
    "temperature": _row_op("temperature", _temperature),
    "top_k": _row_op("top_k", _top_k),
    "top_p": _row_op("top_p", _top_p),
    "min_p": _row_op("min_p", _min_p),
    "sample": sample,
}
