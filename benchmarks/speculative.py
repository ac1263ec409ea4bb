"""Speculative decoding (issue 52): LSE without speculation against LSE with n-gram prompt lookup, side by side
in one run, on the default model (or --model), greedy.

    python benchmarks/speculative.py                         # default model, default devices
    python benchmarks/speculative.py --pool jit:0 --max-tokens 256 --sequences 16

Workloads, one sequence each: code_edit (a generated ~300-line Python file; the request asks for the file back
with one function renamed, so most of the answer stands in the prompt) and chat (an open question, little to
look up). Each reports the reply's decode tok/s (timings.predicted_per_second), the proposals made and kept, and
whether the two replies are the same text (greedy: with --deterministic they must be). With --sequences N, N chat
requests at once report the aggregate tok/s: their reply tokens over the batch's wall time, prefill included,
the same for both. Both engines stay open and take turns, --rounds times, and the medians are reported; the
machine's load average is printed too: other work on its cores moves every figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from typing import Any

from lse_core.api import LSE, lse_close, lse_open_or_raise, lse_request_iter
from lse_core.config import SPEC_TYPES

NAMES = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo",
         "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor"]


def code_file(lines: int) -> str:
    """A Python module of about ``lines`` lines: small functions whose names and bodies differ."""
    out = ['"""Inventory helpers."""', "", "import math", ""]
    i = 0
    while len(out) < lines:
        a, b = NAMES[i % len(NAMES)], NAMES[(i * 7 + 3) % len(NAMES)]
        out += [f"def {a}_{b}_{i}(items, limit={i + 2}):",
                f'    """Return the {a} items above {b} weight, at most limit of them."""',
                f"    chosen = [x for x in items if x.weight > {i * 3 + 1} and x.name != '{b}']",
                f"    total = sum(x.price * {i % 5 + 1} for x in chosen)",
                f"    return chosen[:limit], math.floor(total / {i + 1})", ""]
        i += 1
    return "\n".join(out[:lines]) + "\n"


def workloads(lines: int, max_tokens: int) -> dict[str, dict[str, Any]]:
    source = code_file(lines)
    target = source.split("def ", 3)[2].split("(", 1)[0]    # the second function's name
    return {
        # a completion that starts the edited file: a 135M chat model asked in a chat turn writes about the file
        # instead of writing it out
        "code_edit": {"prompt": f"Original file:\n```python\n{source}```\n\nThe same file with the function "
                                f"{target} renamed to {target}_v2:\n```python\n",
                      "max_tokens": max_tokens, "temperature": 0},
        "chat": {"messages": [{"role": "user", "content": "What should I think about when choosing a first "
                               "programming language? Give me a few ideas."}],
                 "max_tokens": max_tokens, "temperature": 0},
    }


def reply(lse: LSE, body: dict[str, Any]) -> tuple[str, dict[str, Any], float]:
    """The reply's text, its timings and its wall seconds."""
    began = time.perf_counter()
    events = list(lse_request_iter(lse, body, "completion" if "prompt" in body else "chat"))
    seconds = time.perf_counter() - began
    if events[-1].kind != "end":
        raise SystemExit(f"request failed: {events[-1].data}")
    choice = events[-1].data["choices"][0]
    return choice["text"] if "prompt" in body else choice["message"]["content"], events[-1].data["timings"], seconds


def aggregate(lse: LSE, body: dict[str, Any], n: int) -> float:
    """Reply tokens per second of ``n`` copies of ``body`` sent at once (wall time of the whole batch)."""
    tokens = [0] * n

    def one(i: int) -> None:
        tokens[i] = reply(lse, body)[1]["predicted_n"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(tokens) / (time.perf_counter() - began)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model path (default: the default model)")
    p.add_argument("--pool", help="devices (default: those that come up)")
    p.add_argument("--lines", type=int, default=300, help="lines of the code file (default: 300)")
    p.add_argument("--max-tokens", type=int, default=256, help="reply tokens per request (default: 256)")
    p.add_argument("--kv-len", type=int, default=8192, help="context (default: 8192, room for the file twice)")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels: the two replies are then the same text (the default kernels "
                        "pick paths by row count, so rounding can turn a near tie)")
    p.add_argument("--sequences", type=int, default=0, help="also N chat requests at once (default: none)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the two engines taking turns; medians reported")
    args = p.parse_args()
    bodies = workloads(args.lines, args.max_tokens)
    engines = {spec_type: lse_open_or_raise({"model": args.model, "pool": args.pool, "kv_len": args.kv_len,
                                             "spec_type": spec_type, "parallel": max(args.sequences, 1),
                                             "deterministic": args.deterministic})
               for spec_type in SPEC_TYPES}
    last: dict[tuple[str, str], tuple[str, dict[str, Any], float]] = {}
    speeds: dict[tuple[str, str], list[float]] = {}
    try:
        for lse in engines.values():
            reply(lse, dict(bodies["chat"], max_tokens=8))    # warm-up: first-step compiles stay out of the figures
        for _ in range(args.rounds):    # taking turns, so a change of the machine's load hits both alike
            for name, body in bodies.items():
                for spec_type, lse in engines.items():
                    last[name, spec_type] = reply(lse, body)
                    speeds.setdefault((name, spec_type), []).append(last[name, spec_type][1]["predicted_per_second"])
            for spec_type, lse in engines.items():
                if args.sequences:
                    speeds.setdefault(("batched", spec_type), []).append(aggregate(lse, bodies["chat"], args.sequences))
    finally:
        for lse in engines.values():
            lse_close(lse)
    median = {key: statistics.median(values) for key, values in speeds.items()}
    print(f"load average (1, 5, 15 min): {', '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs; "
          f"medians of {args.rounds} rounds")
    print("| workload | reply tokens | decode tok/s, none | ngram | ratio | proposed | kept | same text |")
    print("|---|---|---|---|---|---|---|---|")
    for name in bodies:
        (text_a, _, _), (text_b, ngram, _) = last[name, "none"], last[name, "ngram"]
        print(f"| {name} | {ngram['predicted_n']} | {median[name, 'none']:.1f} | {median[name, 'ngram']:.1f} | "
              f"{median[name, 'ngram'] / median[name, 'none']:.2f}x | {ngram.get('draft_n', 0)} | "
              f"{ngram.get('draft_n_accepted', 0)} | {text_a == text_b} |")
    if args.sequences:
        print(f"| chat x{args.sequences}, aggregate | | {median['batched', 'none']:.1f} | "
              f"{median['batched', 'ngram']:.1f} | {median['batched', 'ngram'] / median['batched', 'none']:.2f}x "
              "| | | |")


if __name__ == "__main__":
    main()
