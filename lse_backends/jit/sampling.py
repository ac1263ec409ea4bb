"""numba kernels for the sampling ops of lse_core.graph.ir, on logits [S, vocab].

A logits processor copies its input into ``out`` and rewrites the rows whose ``needed`` flag is set
(the op's SAMPLING_OP_NEEDED for the step); ``sample`` turns rows into token ids.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types

NEG_INF = np.float32(-np.inf)


@njit(cache=True)
def _probabilities(row):
    e = np.exp(row - row.max())
    return e / e.sum()


@njit(cache=True)
def mask(logits, needed, token_mask, out):
    """-inf for each token whose bit is clear in its row's mask (bit j % 32 of word j // 32)."""
    out[:] = logits
    for i in range(logits.shape[0]):
        if not needed[i]:
            continue
        for j in range(logits.shape[1]):
            if (token_mask[i, j >> 5] >> (j & 31)) & 1 == 0:
                out[i, j] = NEG_INF


@njit(cache=True)
def penalize(logits, needed, repetition_penalty, presence_penalty, recent, out):
    """Divide a positive (multiply a negative) logit of each distinct recent token by the repetition
    penalty, then subtract the presence penalty once from it."""
    out[:] = logits
    vocab = logits.shape[1]
    for i in range(logits.shape[0]):
        if not needed[i]:
            continue
        previous = -1
        for token in np.sort(recent[i]):
            if token < 0 or token >= vocab or token == previous:
                continue
            previous = token
            x = out[i, token]
            if repetition_penalty[i] != 1:
                x = x / repetition_penalty[i] if x > 0 else x * repetition_penalty[i]
            out[i, token] = x - presence_penalty[i]


@njit(cache=True)
def temperature(logits, needed, temperature, out):
    out[:] = logits
    for i in range(logits.shape[0]):
        if needed[i]:
            out[i] /= temperature[i]


@njit(cache=True)
def top_k(logits, needed, top_k, out):
    """Keep the top_k largest logits (ties at the k-th value stay), the others -inf."""
    out[:] = logits
    vocab = logits.shape[1]
    for i in range(logits.shape[0]):
        if needed[i] and top_k[i] < vocab:
            kth = np.partition(logits[i], vocab - top_k[i])[vocab - top_k[i]]
            for j in range(vocab):
                if out[i, j] < kth:
                    out[i, j] = NEG_INF


@njit(cache=True)
def top_p(logits, needed, top_p, out):
    """Keep the smallest prefix by descending probability (id order on ties) whose mass reaches top_p."""
    out[:] = logits
    for i in range(logits.shape[0]):
        if not needed[i]:
            continue
        probs = _probabilities(logits[i])
        order = np.argsort(-probs, kind="mergesort")
        mass = np.float32(0.0)
        for rank in range(order.shape[0]):
            mass += probs[order[rank]]
            if mass >= top_p[i]:
                for dropped in order[rank + 1:]:
                    out[i, dropped] = NEG_INF
                break


@njit(cache=True)
def min_p(logits, needed, min_p, out):
    """Drop tokens whose probability is below min_p times the top probability."""
    out[:] = logits
    for i in range(logits.shape[0]):
        if not needed[i]:
            continue
        probs = _probabilities(logits[i])
        cut = min_p[i] * probs.max()
        for j in range(probs.shape[0]):
            if probs[j] < cut:
                out[i, j] = NEG_INF


# sample's argument types as a step calls it (logits a program's output or a sampling op's np.empty_like of
# it; runner.sampling_arrays' float32 temperature and uniform): compiled ahead on a cold start (program.py).
# The types alone, no return type: numba's disk cache keys an entry by the signature as compile was given it.
SAMPLE_TYPES = (types.float32[:, ::1], types.float32[::1], types.float32[::1], types.int32[::1])


@njit(cache=True)
def sample(logits, temperature, uniform, out):
    """temperature <= 0: argmax (lowest id on ties); otherwise the first token whose cumulative
    softmax weight, in id order, exceeds uniform * total."""
    vocab = logits.shape[1]
    for i in range(logits.shape[0]):
        row = logits[i]
        if temperature[i] <= 0:
            out[i] = np.argmax(row)
            continue
        cumulative = np.cumsum(np.exp(row - row.max()))
        threshold = uniform[i] * cumulative[-1]
        out[i] = vocab - 1
        for j in range(vocab):
            if cumulative[j] > threshold:
                out[i] = j
                break
