"""The plain numpy fp32 reference: a straightforward numpy forward pass of the default model, side by side
with LSE's numpy interpreter (cpu:0) in the same run.

    python benchmarks/plain_numpy.py [--decode-tokens 64] [--prefill-tokens 512] [--repeats 3]

The reference is what a numpy user writes from the model card: weights dequantized to float32 once,
embedding, rms norms, q/k/v projections, rope (Hugging Face rotate_half), a KV cache that grows by every
token, grouped-query attention, SiLU MLP, the tied output projection and argmax. The same function
prefills a prompt (many rows) and decodes (one row). Before timing anything it checks that its greedy ids
equal those of LSE's cpu:0 interpreter (``--check-tokens``), so the figure is a real forward pass.

Figures: decode tok/s (``--decode-tokens`` greedy tokens after a ~32-token prompt, counted from the first
new token to the last) and prefill tok/s (a ``--prefill-tokens`` prompt in one forward), for the reference
and for LSE through lse_core.api with ``--pool cpu:0`` (greedy, raw completion, as benchmarks/compare.py's
lse-cpu0 row measures it). The two alternate ``--repeats`` times; the medians are printed, and LSE ÷
reference as the median of each round's ratio. Both run in this process on OpenBLAS's threads:
OPENBLAS_NUM_THREADS when set, else its default.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from lse_core.graph.ir import rope_inv_freq
from lse_core.model.default import load_model
from lse_core.model.model import Model

DECODE_PROMPT = ("The following is a detailed history of the printing press, written for curious students who "
                 "want to know how books were made before and after it.\n\n")
PREFILL_PASSAGE = ("The printing press changed how knowledge moved. Before it, a book was copied by hand, one page "
                   "at a time, and a single error could travel through every later copy. Movable metal type made a "
                   "page cheap to repeat exactly, so a scholar in one city could cite the same line as another. ")


@dataclass
class Config:
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: np.float32
    inv_freq: np.ndarray   # float32 [head_dim / 2]

    @classmethod
    def of(cls, model: Model) -> Config:
        c = model.config
        head_dim = int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
        rope = {"head_dim": head_dim, "theta": c.get("rope_theta", 10000.0), "scaling": c.get("rope_scaling")}
        return cls(n_layers=c["num_hidden_layers"], n_heads=c["num_attention_heads"],
                   n_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"], head_dim=head_dim,
                   eps=np.float32(c.get("rms_norm_eps") or 1e-6), inv_freq=rope_inv_freq(rope))


class PlainModel:
    """The forward pass of one sequence. Its KV cache holds ``self.length`` positions: each forward
    writes its tokens' keys and values after them and attends over all positions so far."""

    def __init__(self, model: Model, max_len: int) -> None:
        self.config = c = Config.of(model)
        self.w = {name: (t.dequantize() if hasattr(t, "dequantize") else np.asarray(t, np.float32))
                  for name, t in model.weights.items()}
        self.head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])
        self.keys = [np.zeros((max_len, c.n_kv_heads, c.head_dim), np.float32) for _ in range(c.n_layers)]
        self.values = [np.zeros_like(k) for k in self.keys]
        self.length = 0

    def reset(self) -> None:
        self.length = 0

    def rms_norm(self, x: np.ndarray, name: str) -> np.ndarray:
        variance = np.mean(x * x, axis=-1, keepdims=True)
        return x * (1 / np.sqrt(variance + self.config.eps)) * self.w[name]

    def forward(self, tokens: list[int]) -> np.ndarray:
        """Appends ``tokens`` to the sequence; returns the logits of the last one."""
        c, n, start = self.config, len(tokens), self.length
        end = start + n
        group = c.n_heads // c.n_kv_heads
        angles = np.arange(start, end, dtype=np.float32)[:, None] * c.inv_freq[None, :]
        angles = np.concatenate([angles, angles], axis=-1)[:, None, :]   # [n, 1, head_dim]
        cos, sin = np.cos(angles), np.sin(angles)

        def rope(x: np.ndarray) -> np.ndarray:   # x [n, heads, head_dim]
            half = c.head_dim // 2
            rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
            return x * cos + rotated * sin

        future = np.arange(end)[None, :] > np.arange(start, end)[:, None]   # [n, end]: the key follows the query
        x = self.w["model.embed_tokens.weight"][tokens]
        for i in range(c.n_layers):
            p = f"model.layers.{i}."
            h = self.rms_norm(x, p + "input_layernorm.weight")
            q = (h @ self.w[p + "self_attn.q_proj.weight"].T).reshape(n, c.n_heads, c.head_dim)
            k = (h @ self.w[p + "self_attn.k_proj.weight"].T).reshape(n, c.n_kv_heads, c.head_dim)
            v = (h @ self.w[p + "self_attn.v_proj.weight"].T).reshape(n, c.n_kv_heads, c.head_dim)
            self.keys[i][start:end] = rope(k)
            self.values[i][start:end] = v
            # grouped-query attention: the query heads of one kv head as one [group * n, head_dim] matrix
            qg = rope(q).reshape(n, c.n_kv_heads, group, c.head_dim).transpose(1, 2, 0, 3)  # [kv, g, n, d]
            keys = self.keys[i][:end].transpose(1, 2, 0)[:, None]     # [kv, 1, d, end]
            scores = (qg @ keys) * np.float32(c.head_dim ** -0.5)     # [kv, g, n, end]
            if n > 1:
                scores[..., future] = -np.inf
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs = scores / scores.sum(axis=-1, keepdims=True)
            mixed = probs @ self.values[i][:end].transpose(1, 0, 2)[:, None]   # [kv, g, n, d]
            attn = mixed.transpose(2, 0, 1, 3).reshape(n, c.n_heads * c.head_dim)
            x = x + attn @ self.w[p + "self_attn.o_proj.weight"].T
            h = self.rms_norm(x, p + "post_attention_layernorm.weight")
            gate = h @ self.w[p + "mlp.gate_proj.weight"].T
            up = h @ self.w[p + "mlp.up_proj.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ self.w[p + "mlp.down_proj.weight"].T
        self.length = end
        return self.rms_norm(x[-1:], "model.norm.weight")[0] @ self.head.T

    def greedy(self, prompt: list[int], n_new: int) -> tuple[list[int], list[float]]:
        """Greedy ids after ``prompt`` and the time each was ready."""
        self.reset()
        ids, times = [int(np.argmax(self.forward(prompt)))], [time.perf_counter()]
        while len(ids) < n_new:
            ids.append(int(np.argmax(self.forward(ids[-1:]))))
            times.append(time.perf_counter())
        return ids, times


def decode_rate(times: list[float]) -> float:
    """tok/s from the first new token to the last: decode only, the prompt's forward left out."""
    return (len(times) - 1) / (times[-1] - times[0])


def lse_interpreter_greedy(model: Model, prompt: list[int], n_new: int) -> list[int]:
    """Greedy ids of LSE's graph on the cpu:0 interpreter, driven step by step (prompt, then one row a step)."""
    from lse_backends.cpu import CPUDevice
    from lse_core.devices.hookspec import CompileContext
    from lse_core.graph.ir import PENALTY_WINDOW, SamplingBatch, Step
    from lse_core.graph.plan import Plan
    from lse_core.model.arch import build_graph

    device = CPUDevice()
    ctx = CompileContext(kv_slots=1, kv_len=len(prompt) + n_new, max_tokens=len(prompt))
    plan = Plan.build(build_graph(model), [device], ctx)

    def one(value: float, dtype: type = np.float32) -> np.ndarray:
        return np.array([value], dtype)

    greedy = SamplingBatch(temperature=one(0), top_k=one(0, np.int32), top_p=one(1), min_p=one(0),
                           repetition_penalty=one(1), presence_penalty=one(0),
                           recent=np.full((1, PENALTY_WINDOW), -1, np.int32), uniform=one(0))
    ids: list[int] = []
    rows, position = list(prompt), 0
    while len(ids) < n_new:
        n = len(rows)
        step = Step(np.array(rows, np.int32), np.arange(position, position + n, dtype=np.int32),
                    np.zeros(1, np.int32), np.array([0, n], np.int32), np.array([n - 1], np.int32), greedy)
        ids.append(int(plan.run(step).next_tokens[0]))
        rows, position = ids[-1:], position + n
    device.close()
    return ids


class LSEInterpreter:
    """LSE with --pool cpu:0 through lse_core.api, as compare.py's lse-cpu0 row runs it."""

    def __init__(self, kv_len: int) -> None:
        from lse_core.api import lse_open_or_raise
        from lse_core.config import LSEConfig

        self.lse = lse_open_or_raise(LSEConfig(pool="cpu:0", kv_len=kv_len))

    def complete(self, prompt: list[int], max_tokens: int) -> tuple[list[float], dict[str, Any]]:
        """The arrival time of each token event and the response object."""
        from lse_core.api import EVENT_END, EVENT_TOKEN, lse_request

        times: list[float] = []
        outcome: dict[str, Any] = {}

        def on_event(event: Any) -> None:
            if event.kind == EVENT_TOKEN:
                times.append(time.perf_counter())
            else:
                outcome[event.kind] = event.data

        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "repetition_penalty": 1.0,
                "presence_penalty": 0.0}
        lse_request(self.lse, body, on_event, "completion").done.wait()
        if EVENT_END not in outcome:
            raise RuntimeError(f"LSE request failed: {outcome}")
        return times, outcome[EVENT_END]

    def decode_rate(self, prompt: list[int], n_new: int) -> float:
        times, response = self.complete(prompt, n_new)
        if response["usage"]["completion_tokens"] != len(times):   # an event per token, or the rate is off
            raise RuntimeError(f"{len(times)} token events for {response['usage']['completion_tokens']} tokens")
        return decode_rate(times)

    def prefill_rate(self, prompt: list[int]) -> float:
        _, response = self.complete(prompt, 1)
        if (response["usage"].get("prompt_tokens_details") or {}).get("cached_tokens"):
            raise RuntimeError("the prefill prompt hit LSE's prefix cache; the figure would be void")
        return response["timings"]["prompt_per_second"]


def threads_note() -> str:
    value = os.environ.get("OPENBLAS_NUM_THREADS")
    if value:
        return f"OPENBLAS_NUM_THREADS={value}"
    return f"OPENBLAS_NUM_THREADS unset (OpenBLAS's default: one thread per core, {os.cpu_count()})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--check-tokens", type=int, default=16, help="greedy ids that must equal LSE cpu:0's")
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds of reference and LSE")
    args = p.parse_args(argv)

    model = load_model(None)
    tokenizer = model.tokenizer
    decode_prompt = tokenizer.encode(DECODE_PROMPT, add_special_tokens=True)
    text = PREFILL_PASSAGE
    while len(tokenizer.encode(text, add_special_tokens=True)) <= args.prefill_tokens:
        text += PREFILL_PASSAGE
    prefill_prompt = tokenizer.encode(text, add_special_tokens=True)[:args.prefill_tokens]
    kv_len = max(args.prefill_tokens, len(decode_prompt) + max(args.decode_tokens, args.check_tokens)) + 8
    print(f"threads: {threads_note()}; decode prompt {len(decode_prompt)} tokens, {args.decode_tokens} new; "
          f"prefill prompt {len(prefill_prompt)} tokens", flush=True)

    plain = PlainModel(model, kv_len)
    reference_ids, _ = plain.greedy(decode_prompt, args.check_tokens)
    lse_ids = lse_interpreter_greedy(model, decode_prompt, args.check_tokens)
    if reference_ids != lse_ids:
        print(f"MISMATCH: the reference's greedy ids {reference_ids}\n  differ from LSE cpu:0's {lse_ids}")
        return 1
    print(f"greedy ids equal LSE cpu:0's for {args.check_tokens} tokens: {tokenizer.decode(reference_ids)!r}")

    lse = LSEInterpreter(kv_len)
    warmup = decode_prompt[1:] + decode_prompt[:1]
    plain.greedy(warmup, 4)
    lse.decode_rate(warmup, 4)
    figures: dict[str, list[float]] = {"plain decode": [], "LSE decode": [], "plain prefill": [], "LSE prefill": []}
    for round_ in range(args.repeats):
        figures["plain decode"].append(decode_rate(plain.greedy(decode_prompt, args.decode_tokens)[1]))
        figures["LSE decode"].append(lse.decode_rate(decode_prompt, args.decode_tokens))
        # rotated each round: the same work, but no prefix LSE's prefix cache could serve
        prefill = prefill_prompt[round_ + 1:] + prefill_prompt[:round_ + 1]
        plain.reset()
        t0 = time.perf_counter()
        plain.forward(prefill)
        figures["plain prefill"].append(len(prefill) / (time.perf_counter() - t0))
        figures["LSE prefill"].append(lse.prefill_rate(prefill))
        print(f"round {round_ + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in figures.items()), flush=True)

    median = {k: statistics.median(v) for k, v in figures.items()}
    # each round's own ratio, then their median: a round's two runs are adjacent in time, so load from
    # other processes mostly hits both
    ratio = {kind: statistics.median(a / b for a, b in zip(figures[f"LSE {kind}"], figures[f"plain {kind}"]))
             for kind in ("decode", "prefill")}
    print(f"\nmedians of {args.repeats} rounds, tok/s:")
    print(f"  plain numpy fp32 decode: {median['plain decode']:.1f}   prefill: {median['plain prefill']:.1f}")
    print(f"  LSE cpu:0 decode:        {median['LSE decode']:.1f}   prefill: {median['LSE prefill']:.1f}")
    print(f"  LSE ÷ plain numpy (median of the rounds' ratios): decode {ratio['decode']:.2f}   "
          f"prefill {ratio['prefill']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
