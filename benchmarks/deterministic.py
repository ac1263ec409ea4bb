"""--deterministic's cost: prefill and decode speed with and without it, at 1 and 16 sequences, in one run.

    python benchmarks/deterministic.py                      # default model, default pool, 2 rounds
    python benchmarks/deterministic.py --pool cpu:0 --rounds 3 --json out.json

Both engines are open at once (one with the mode, one without) and take turns each round, so a noisy
minute lands on both. Replies are raw completions with ignore_eos, greedy, so every run decodes as many
tokens.

  prefill      tokens per second of a --prefill-tokens prompt that no prefix cache holds (timings)
  decode @1    tokens per second of one request's decode (its timings.predicted_per_second)
  decode @16   16 requests at once: every reply token over the wall time from submit to the last reply
  ratio        deterministic / default, the median of the rounds' ratios
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from lse_core.api import LSE, lse_close, lse_open_or_raise, lse_request_iter

PASSAGE = ("The printing press changed how knowledge moved. Before it, a book was copied by hand, one page at a "
           "time, and a single error could travel through every later copy. Movable metal type made a page cheap "
           "to repeat exactly, so a scholar in one city could cite the same line as a scholar in another. ")
TOPICS = ("the steam engine", "the telescope", "the printing press", "the compass", "paper money", "the clock",
          "the railway", "the telegraph", "vaccination", "the bicycle", "the microscope", "canals",
          "the postal service", "glass making", "windmills", "the lighthouse")
MODES = ("default", "deterministic")


def finished(lse: LSE, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
    end = list(lse_request_iter(lse, {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                      "ignore_eos": True}, "completion"))[-1]
    assert end.kind == "end", end.data
    return end.data


def prefill(lse: LSE, prompt: list[int]) -> float:
    reply = finished(lse, prompt, 1)
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "the prefill prompt came from the cache"
    return reply["timings"]["prompt_per_second"]


def decode_one(lse: LSE, max_tokens: int) -> float:
    return finished(lse, f"A short history of {TOPICS[0]}:", max_tokens)["timings"]["predicted_per_second"]


def decode_sixteen(lse: LSE, max_tokens: int) -> float:
    tokens = [0] * len(TOPICS)

    def run(i: int) -> None:
        tokens[i] = finished(lse, f"A short history of {TOPICS[i]}:", max_tokens)["usage"]["completion_tokens"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(TOPICS))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(tokens) / (time.perf_counter() - start)


def take_turns(engines: dict[str, LSE], n_rounds: int, prefill_tokens: int, max_tokens: int) -> list[dict]:
    """Each engine warmed up, then ``n_rounds`` rounds in which each in turn measures prefill, decode @1 and
    @16 (each round's figures by engine); the engines are closed at the end."""
    try:
        first = next(iter(engines.values()))
        text = first.model.tokenizer.encode(PASSAGE * (4 + prefill_tokens // 40), False)
        offsets = itertools.count()   # each prefill prompt starts at another token: no prefix cache serves it
        for lse in engines.values():  # warm up: kernels compile, every step size's path runs once
            prefill(lse, text[next(offsets):][:prefill_tokens])
            decode_sixteen(lse, 4)
        return [{name: {"prefill": prefill(lse, text[next(offsets):][:prefill_tokens]),
                        "decode_1": decode_one(lse, max_tokens), "decode_16": decode_sixteen(lse, max_tokens)}
                 for name, lse in engines.items()} for _ in range(n_rounds)]
    finally:
        for lse in engines.values():
            lse_close(lse)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", help="a GGUF file or HF directory (default: the default model)")
    parser.add_argument("--pool", help="devices, as lse's --pool (default: LSE's own choice)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", help="write every round's figures here")
    args = parser.parse_args()
    config = {"model": args.model, "pool": args.pool, "parallel": len(TOPICS),
              "kv_len": args.prefill_tokens + args.max_tokens + 16, "prefill_chunk": args.prefill_tokens}
    engines = {mode: lse_open_or_raise(config | {"deterministic": mode == "deterministic"}) for mode in MODES}
    rounds = take_turns(engines, args.rounds, args.prefill_tokens, args.max_tokens)

    lse = engines["default"]
    print(f"model {lse.model_id}, pool {[d.info.name for d in lse.devices]}, {args.rounds} rounds, prefill "
          f"{args.prefill_tokens} tokens, max_tokens {args.max_tokens}, "
          f"NUMBA_NUM_THREADS={os.environ.get('NUMBA_NUM_THREADS', 'unset')}")
    print(f"{'tok/s':14}{'default':>10}{'deterministic':>15}{'ratio':>8}")
    for key, label in (("prefill", "prefill"), ("decode_1", "decode @1"), ("decode_16", "decode @16")):
        default, deterministic = (statistics.median(r[mode][key] for r in rounds) for mode in MODES)
        ratio = statistics.median(r["deterministic"][key] / r["default"][key] for r in rounds)
        print(f"{label:14}{default:10.1f}{deterministic:15.1f}{ratio:8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rounds}, indent=2))


if __name__ == "__main__":
    main()
