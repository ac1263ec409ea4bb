"""Where an LSE engine's resident memory goes, as compare.py's LSE row runs it (LSEConfig(parallel=16) on the
pool LSE picks, or --pool): a 512-token prefill, then 16 sequences decoding 64 tokens each.

    python benchmarks/memory.py [-m model.gguf] [--cache-type-k f16] [--cache-type-v f16] [--json out.json]

Peak RSS (VmHWM) and the resident set at the end broken down:
  weights        the model file's pages still resident, and the devices' own layouts of the weights (jit:0)
  KV cache       the attention caches' resident pages (the OS commits a slot's pages as they are written)
  activations    the jit programs' activation buffers (rows of a prefill chunk, reused every step)
  libraries      file-backed pages of shared libraries (LLVM's is most of them), and of Python's modules
  the rest       Python's and numba's heap, LLVM's compiled code and its modules, numpy's scratch
Resident pages of an array are counted with mincore(2); the rest are /proc/self/smaps' figures. Run it in
a fresh process (it is one): VmHWM counts from exec.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

MIB = 1 << 20
PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


def resident_bytes(arrays: list[np.ndarray]) -> int:
    """Resident bytes of the pages under these arrays (each page once)."""
    pages: set[int] = set()
    for array in arrays:
        if array.nbytes == 0:
            continue
        start = array.__array_interface__["data"][0] // PAGE * PAGE
        count = (array.__array_interface__["data"][0] + array.nbytes - start + PAGE - 1) // PAGE
        vector = (ctypes.c_ubyte * count)()
        if _libc.mincore(start, count * PAGE, vector) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        pages.update(start + i * PAGE for i in range(count) if vector[i] & 1)
    return len(pages) * PAGE


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def mapped_rss() -> dict[str, int]:
    """Resident bytes by what backs each mapping: its file's path, or '' for anonymous memory."""
    by_path: dict[str, int] = {}
    path = ""
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            path = fields[5] if len(fields) > 5 and fields[5].startswith("/") else ""
        elif fields[0] == "Rss:":
            by_path[path] = by_path.get(path, 0) + int(fields[1]) * 1024
    return by_path


def jit_arrays(lse: Any) -> dict[str, list[np.ndarray]]:
    """The jit device's weight layouts, KV caches and activation buffers, from the plan's programs."""
    from lse_backends.jit import JitDevice, program

    found: dict[str, list[np.ndarray]] = {"weights": [], "kv": [], "activations": []}
    for device in lse.devices:
        if isinstance(device, JitDevice):
            for _, form in device._prepared.values():
                found["weights"].append(form[1] if isinstance(form, tuple) else form)
    for stage in lse.plan.stages:
        if isinstance(stage.kernel, program.Program):
            found["kv"] += [a for i in stage.kernel.instructions if i.op == program.ATTENTION for a in i.args[:2]]
            found["activations"] += list({id(a): a for a in stage.kernel.acts}.values())
    return found


def workload(lse: Any, prefill_tokens: int, n_seqs: int, n_new: int) -> None:
    from lse_core.api import lse_request

    text = " ".join(f"Part {i}: the printing press changed how knowledge moved, a page at a time." for i in range(200))
    ids = lse.model.tokenizer.encode(text, False)[:prefill_tokens]
    for prompts, max_tokens in (([ids], 1), ([ids[i::n_seqs][:16] for i in range(n_seqs)], n_new)):
        requests = [lse_request(lse, {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
                                lambda event: None, "completion") for p in prompts]
        for r in requests:
            if not r.done.wait(1800):
                raise TimeoutError("a request did not finish")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-m", "--model")
    p.add_argument("--pool")
    p.add_argument("--cache-type-k")
    p.add_argument("--cache-type-v")
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--json")
    args = p.parse_args()
    stages = {"python + numpy": status_kib("VmRSS") * 1024}
    import lse_backends.jit  # noqa: F401  (numba and llvmlite, as lse_open loads them)
    from lse_core.api import lse_close, lse_open_or_raise
    from lse_core.config import LSEConfig
    stages["+ LSE, numba, llvmlite imported"] = status_kib("VmRSS") * 1024
    lse = lse_open_or_raise(LSEConfig(model=args.model, pool=args.pool, parallel=16,
                                      cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v))
    stages["+ engine open (weights laid out, kernels loaded)"] = status_kib("VmRSS") * 1024
    workload(lse, args.prefill_tokens, 16, 64)
    stages["+ 512-token prefill and 16 x 64 decode"] = status_kib("VmRSS") * 1024
    rss, peak = status_kib("VmRSS") * 1024, status_kib("VmHWM") * 1024
    arrays = jit_arrays(lse)
    by_path = mapped_rss()
    model_file = os.path.realpath(lse.model.source)
    parts = {
        "weights: the file's resident pages": by_path.get(model_file, 0),
        "weights: the devices' layouts": resident_bytes(arrays["weights"]),
        "KV cache": resident_bytes(arrays["kv"]),
        "activations": resident_bytes(arrays["activations"]),
        "libraries (file-backed: LLVM's, numpy's, Python's)": sum(v for k, v in by_path.items()
                                                                  if k and k != model_file),
    }
    parts["the rest (heaps: Python, numba, LLVM's compiled code)"] = rss - sum(parts.values())
    ctx = lse.plan.ctx
    lse_close(lse)
    record = {"model": os.path.basename(model_file), "pool": [d.info.name for d in lse.devices],
              "cache_type_k": ctx.cache_type_k, "cache_type_v": ctx.cache_type_v,
              "peak_rss_mib": peak / MIB, "rss_mib": rss / MIB,
              "stages_mib": {k: v / MIB for k, v in stages.items()},
              "parts_mib": {k: v / MIB for k, v in parts.items()}}
    print(f"{record['model']} on {', '.join(record['pool'])}, KV cache k {ctx.cache_type_k} / v {ctx.cache_type_v}")
    print(f"peak RSS {peak / MIB:.0f} MiB; at the end {rss / MIB:.0f} MiB\n")
    print("| stage | RSS MiB |\n|---|---:|")
    for k, v in stages.items():
        print(f"| {k} | {v / MIB:.0f} |")
    print("\n| at the end | MiB |\n|---|---:|")
    for k, v in parts.items():
        print(f"| {k} | {v / MIB:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
