"""Structured output's cost: decode speed with and without a JSON schema, at 1 and 16 sequences, in one run,
and what a schema adds to the time to first token.

    python benchmarks/structured.py                 # default model, default pool, 3 rounds
    python benchmarks/structured.py --pool cpu:0 --rounds 5 --json out.json

Each round runs every mode once, the modes taking turns, so a noisy minute lands on both. The prompts are
the real-world schemas' questions (tests/structured_schemas.py) whose JSON runs past --max-tokens; a
constrained request sends the schema as response_format, a free one the same messages without it and with
ignore_eos, so both modes decode the same number of tokens (the figures say how many each did).

  decode @1    tokens per second of one request's decode (its timings.predicted_per_second), median
  decode @16   16 requests at once: every reply token over the wall time from submit to the last reply
  first token  seconds from submit to the first streamed token, median; the schema's compile is in it
  compile      constraint_grammar + the llguidance matcher, per schema, in milliseconds (median of 20): first
               seen (each sample a new title: the compile worker's proof, then the compile) and seen again
               (a copy of the cached matcher)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from structured_schemas import REAL_WORLD  # noqa: E402  (test data, not a package)

from lse_core import structured  # noqa: E402
from lse_core.api import LSE, lse_close, lse_open_or_raise, lse_request_iter  # noqa: E402
from lse_core.protocol import OutputConstraint  # noqa: E402

LONG = {name: case for name, case in REAL_WORLD.items() if name != "classify"}   # its JSON is 14 tokens


def body(question: str, schema: dict[str, Any] | None, max_tokens: int) -> dict[str, Any]:
    request: dict[str, Any] = {"messages": [{"role": "user", "content": question}], "temperature": 0,
                               "max_tokens": max_tokens}
    if schema is None:
        request["ignore_eos"] = True
    else:
        request["response_format"] = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}
    return request


def finished(lse: LSE, request: dict[str, Any]) -> dict[str, Any]:
    end = list(lse_request_iter(lse, request))[-1]
    assert end.kind == "end", end.data
    return end.data


def first_token_seconds(lse: LSE, request: dict[str, Any]) -> float:
    start = time.perf_counter()
    for event in lse_request_iter(lse, request | {"stream": True}):
        if event.kind == "token" and any(c["delta"].get("content") for c in event.data["choices"]):
            return time.perf_counter() - start
    raise AssertionError("the reply streamed no content")


def decode_one(lse: LSE, constrained: bool, max_tokens: int) -> tuple[float, float]:
    """Median tokens/s of each question's decode alone, and the mean reply length."""
    replies = [finished(lse, body(q, s if constrained else None, max_tokens)) for q, s in LONG.values()]
    return (statistics.median(r["timings"]["predicted_per_second"] for r in replies),
            statistics.mean(r["usage"]["completion_tokens"] for r in replies))


def decode_sixteen(lse: LSE, constrained: bool, max_tokens: int) -> tuple[float, float]:
    """Aggregate tokens/s of 16 requests at once (the questions in turn), and the mean reply length."""
    questions = [list(LONG.values())[i % len(LONG)] for i in range(16)]
    replies: list[dict[str, Any]] = [{}] * len(questions)

    def run(i: int) -> None:
        q, s = questions[i]
        replies[i] = finished(lse, body(q, s if constrained else None, max_tokens))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(questions))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    tokens = [r["usage"]["completion_tokens"] for r in replies]
    return sum(tokens) / wall, statistics.mean(tokens)


def compile_ms(lse: LSE) -> dict[str, float]:
    def sample(schema: dict[str, Any]) -> float:
        start = time.perf_counter()
        lse.grammars.matcher(structured.constraint_grammar(OutputConstraint("json_schema", schema, "s"),
                                                           lse.grammars), "s")
        return (time.perf_counter() - start) * 1000

    times = {}
    lse.grammars.matcher(structured.constraint_grammar(OutputConstraint("json_schema", {}, "s"), lse.grammars),
                         "s")   # the compile worker starts
    for name, (_, schema) in REAL_WORLD.items():
        times[f"{name} first"] = statistics.median(sample(schema | {"title": f"{name} {i}"}) for i in range(20))
        times[f"{name} again"] = statistics.median(sample(schema) for _ in range(20))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", help="a GGUF file or HF directory (default: the default model)")
    parser.add_argument("--pool", help="devices, as lse's --pool (default: LSE's own choice)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", help="write every round's figures here")
    args = parser.parse_args()
    lse = lse_open_or_raise({"model": args.model, "pool": args.pool, "parallel": 16, "kv_len": 2048})
    try:
        for q, s in REAL_WORLD.values():   # warm up: kernels, the grammar vocabulary, both paths
            finished(lse, body(q, s, 8))
            finished(lse, body(q, None, 8))
        rounds = []
        for _ in range(args.rounds):
            figures: dict[str, Any] = {}
            for mode in ("free", "constrained"):
                constrained = mode == "constrained"
                figures[mode] = {
                    "decode_1": decode_one(lse, constrained, args.max_tokens),
                    "decode_16": decode_sixteen(lse, constrained, args.max_tokens),
                    "first_token_s": statistics.median(first_token_seconds(lse, body(q, s if constrained else None, 1))
                                                       for q, s in REAL_WORLD.values()),
                }
            rounds.append(figures)
        compile_times = compile_ms(lse)
    finally:
        lse_close(lse)

    def median(mode: str, key: str, index: int | None = None) -> float:
        values = [r[mode][key] if index is None else r[mode][key][index] for r in rounds]
        return statistics.median(values)

    print(f"model {lse.model_id}, pool {[d.info.name for d in lse.devices]}, {args.rounds} rounds, "
          f"max_tokens {args.max_tokens}, NUMBA_NUM_THREADS={os.environ.get('NUMBA_NUM_THREADS', 'unset')}")
    print(f"{'':16}{'free':>12}{'constrained':>14}{'ratio':>8}   mean reply tokens (free / constrained)")
    for key, label in (("decode_1", "decode @1 tok/s"), ("decode_16", "decode @16 tok/s")):
        free, constrained = median("free", key, 0), median("constrained", key, 0)
        lengths = f"{median('free', key, 1):.0f} / {median('constrained', key, 1):.0f}"
        print(f"{label:16}{free:12.1f}{constrained:14.1f}{constrained / free:8.2f}   {lengths}")
    free_ttft, constrained_ttft = median("free", "first_token_s"), median("constrained", "first_token_s")
    added_ms = (constrained_ttft - free_ttft) * 1000
    print(f"{'first token s':16}{free_ttft:12.3f}{constrained_ttft:14.3f}   {added_ms:+.1f} ms")
    print("schema compile ms: " + ", ".join(f"{name} {ms:.1f}" for name, ms in compile_times.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rounds, "compile_ms": compile_times}, indent=2))


if __name__ == "__main__":
    main()
