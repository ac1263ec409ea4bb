"""What loading a model costs and what unloading it gives back, in one process through lse_core.model_set:
each round loads the model, answers one greedy chat turn, unloads it, and prints the load time and the
process's RSS loaded, after the reply and after the unload (psutil).

    NUMBA_NUM_THREADS=2 python benchmarks/model_unload.py --pool jit:0 --rounds 3
    OPENBLAS_NUM_THREADS=2 python benchmarks/model_unload.py --pool cpu:0 --rounds 3 [-m PATH]
"""

from __future__ import annotations

import argparse
import time

import psutil

from lse_core.config import LSEConfig
from lse_core.model.catalog import model_specs
from lse_core.model_set import ModelSet

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def mib() -> int:
    return psutil.Process().memory_info().rss >> 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", help="a .gguf file or Hugging Face directory (default: SmolLM2-135M)")
    p.add_argument("--pool", default="jit:0")
    p.add_argument("--kv-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    models = ModelSet(model_specs([args.model] if args.model else []), LSEConfig(pool=args.pool, kv_len=args.kv_len))
    (model_id,) = models.ids
    print(f"{model_id} on {args.pool}; RSS at start {mib()} MiB")
    print("round  load s  RSS loaded  after reply  after unload  (MiB; load's own measure)")
    for round_ in range(args.rounds):
        start = time.monotonic()
        models.load(model_id).result()
        seconds, loaded = time.monotonic() - start, mib()
        *_, end = models.request_iter({"model": model_id, "messages": QUESTION, "max_tokens": 20, "temperature": 0})
        replied = mib()
        measured = models.status(model_id)["memory_bytes"] >> 20
        models.unload(model_id)
        print(f"{round_:5}  {seconds:6.1f}  {loaded:10}  {replied:11}  {mib():12}  ({measured})")
    models.close()


if __name__ == "__main__":
    main()
