"""The KV cache types' speed: prefill and decode at 1 and 16 sequences with each --cache-type (keys and values
alike), the engines open at once and taking turns each round, as deterministic.py measures its mode.

    python benchmarks/kv_cache.py                             # f32 against f16, default model and pool
    python benchmarks/kv_cache.py --types f32,f16,q8_0 --rounds 3 --json out.json

ratio: each type's tok/s over the first type's, the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from deterministic import TOPICS, take_turns

from lse_core.api import lse_open_or_raise

FIGURES = (("prefill", "prefill"), ("decode_1", "decode @1"), ("decode_16", "decode @16"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", help="a GGUF file or HF directory (default: the default model)")
    parser.add_argument("--pool", help="devices, as lse's --pool (default: LSE's own choice)")
    parser.add_argument("--types", default="f32,f16", help="cache types to compare, the first the baseline")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", help="write every round's figures here")
    args = parser.parse_args()
    kinds = args.types.split(",")
    config = {"model": args.model, "pool": args.pool, "parallel": len(TOPICS),
              "kv_len": args.prefill_tokens + args.max_tokens + 16, "prefill_chunk": args.prefill_tokens}
    engines = {kind: lse_open_or_raise(config | {"cache_type_k": kind, "cache_type_v": kind}) for kind in kinds}
    rounds = take_turns(engines, args.rounds, args.prefill_tokens, args.max_tokens)

    lse = engines[kinds[0]]
    print(f"model {lse.model_id}, pool {[d.info.name for d in lse.devices]}, {args.rounds} rounds, prefill "
          f"{args.prefill_tokens} tokens, max_tokens {args.max_tokens}, "
          f"NUMBA_NUM_THREADS={os.environ.get('NUMBA_NUM_THREADS', 'unset')}")
    print("| tok/s | " + " | ".join(kinds) + " | " + " | ".join(f"{k} / {kinds[0]}" for k in kinds[1:]) + " |")
    print("|---" * (2 * len(kinds)) + "|")
    for key, label in FIGURES:
        speeds = [statistics.median(r[kind][key] for r in rounds) for kind in kinds]
        ratios = [statistics.median(r[kind][key] / r[kinds[0]][key] for r in rounds) for kind in kinds[1:]]
        print(f"| {label} | " + " | ".join(f"{s:.1f}" for s in speeds) + " | "
              + " | ".join(f"{r:.2f}" for r in ratios) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rounds}, indent=2))


if __name__ == "__main__":
    main()
