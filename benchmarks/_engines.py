"""One engine's side of benchmarks/compare.py, run in a subprocess of its own so its peak RSS is its own.

    python benchmarks/_engines.py ENGINE SPEC.json OUT.json

ENGINE is one of ENGINES. SPEC.json (written by compare.py) holds the model path, the token ids of every
prompt, the stop ids, the token budgets and the thread count; OUT.json receives the figures. Every engine
gets the same token ids and decodes greedily, and each one's heavy imports happen here, not in compare.py.

A decode run returns one Stream per sequence: the time each of its tokens arrived. Aggregate decode
tok/s is counted over the window in which every sequence of the run is decoding (from the last
sequence's first token to the first sequence's last token), so prefill and stragglers stay out of it.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

ENGINES = ("lse", "lse-cpu0", "llama.cpp", "transformers")
GGML_TYPES = {"f32": 0, "f16": 1, "q8_0": 8}   # llama.cpp's type ids for --cache-type-k/-v (ggml.h's ggml_type)
LLAMA_CPP_INSTALL = ("python benchmarks/install_llama_cpp.py (builds llama.cpp from source with the flags this "
                     "CPU needs, ~6 minutes on 2 cores)")


class EngineMissing(Exception):
    """The engine's library is not installed: the row is skipped, with how to install it."""


@dataclass
class Stream:
    """One sequence of a decode run: arrival times of its token events and the tokens they carried."""

    t_start: float = 0.0                # when the request was made
    times: list[float] = field(default_factory=list)
    n_tokens: int = 0                   # tokens generated; an event may carry more than one (held-back UTF-8)
    token_ids: list[int] | None = None  # the generated ids, where the engine gives them
    text: str | None = None             # the generated text, where it gives text instead


def decode_rate(streams: list[Stream]) -> float | None:
    """Aggregate tok/s over the window in which all streams decode; None when they never overlap."""
    timed = [s for s in streams if s.times]
    if not timed:
        return None
    start, end = max(s.times[0] for s in timed), min(s.times[-1] for s in timed)
    if end <= start:
        return None
    tokens = sum(sum(start < t <= end for t in s.times) * s.n_tokens / len(s.times) for s in timed)
    return tokens / (end - start)


def memory_mib() -> dict[str, float]:
    """This process's resident set now and at its peak, in MiB. VmHWM starts afresh at exec; ru_maxrss
    would not do here, as Linux carries it across fork and exec from compare.py's own peak."""
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    return {"rss": float(status["VmRSS"].split()[0]) / 1024, "hwm": float(status["VmHWM"].split()[0]) / 1024}


class LSEEngine:
    """LSE through its in-process API; N concurrent requests come from N threads sharing one batch."""

    max_batch = 16

    def __init__(self, spec: dict[str, Any], pool: str | None) -> None:
        from lse_core.api import lse_open_or_raise
        from lse_core.config import LSEConfig

        self.lse = lse_open_or_raise(LSEConfig(model=spec["model"], pool=pool, parallel=self.max_batch,
                                               kv_len=spec["kv_len"], cache_type_k=spec["cache_type_k"],
                                               cache_type_v=spec["cache_type_v"]))
        self.devices = [d.info.name for d in self.lse.devices]

    def _request(self, prompt: list[int], max_tokens: int, stream: Stream) -> dict[str, Any]:
        """Run one completion to its end, timing its token events; returns the response object."""
        from lse_core.api import EVENT_END, EVENT_TOKEN, lse_request

        outcome: dict[str, Any] = {}

        def on_event(event: Any) -> None:
            if event.kind == EVENT_TOKEN:
                stream.times.append(time.perf_counter())
            else:
                outcome[event.kind] = event.data

        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "repetition_penalty": 1.0,
                "presence_penalty": 0.0}
        stream.t_start = time.perf_counter()
        request = lse_request(self.lse, body, on_event, "completion")
        request.done.wait()
        if EVENT_END not in outcome:
            raise RuntimeError(f"LSE request failed: {outcome}")
        response = outcome[EVENT_END]
        stream.n_tokens = response["usage"]["completion_tokens"]
        stream.text = response["choices"][0]["text"]
        return response

    def prefill(self, prompt: list[int]) -> tuple[float, float]:
        stream = Stream()
        response = self._request(prompt, 1, stream)
        cached = (response["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        if cached:
            raise RuntimeError(f"the prefill prompt hit LSE's prefix cache ({cached} tokens); the figure would be void")
        if not stream.times:
            raise RuntimeError("LSE's first token carried no text, so its arrival was not seen")
        return stream.times[0] - stream.t_start, response["timings"]["prompt_per_second"]

    def decode(self, prompts: list[list[int]], max_tokens: int) -> list[Stream]:
        streams = [Stream() for _ in prompts]
        barrier = threading.Barrier(len(prompts))
        errors: list[BaseException] = []

        def run(prompt: list[int], stream: Stream) -> None:
            barrier.wait()
            try:
                self._request(prompt, max_tokens, stream)
            except BaseException as e:  # re-raised in the main thread
                errors.append(e)

        threads = [threading.Thread(target=run, args=args) for args in zip(prompts, streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return streams


class LlamaCppEngine:
    """llama.cpp through llama-cpp-python: one sequence per Llama object, so decode is single-stream only."""

    max_batch = 1

    def __init__(self, spec: dict[str, Any]) -> None:
        try:
            from llama_cpp import Llama
        except ImportError as e:
            raise EngineMissing(f"llama-cpp-python is not installed; install it with: {LLAMA_CPP_INSTALL}") from e

        quantized_v = spec["cache_type_v"] != "f16" and spec["cache_type_v"] != "f32"
        self.llm = Llama(spec["model"], n_ctx=spec["kv_len"], n_batch=512, n_threads=spec["threads"],
                         n_threads_batch=spec["threads"], type_k=GGML_TYPES[spec["cache_type_k"]],
                         type_v=GGML_TYPES[spec["cache_type_v"]], flash_attn=quantized_v, verbose=False)
        self.stop_ids = set(spec["stop_ids"])
        self.devices = [f"cpu, {spec['threads']} threads"]

    def prefill(self, prompt: list[int]) -> tuple[float, float]:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(prompt)
        prefill_s = time.perf_counter() - t0
        stream = self._generate(prompt, 1)
        return stream.times[0] - stream.t_start, len(prompt) / prefill_s

    def _generate(self, prompt: list[int], max_tokens: int) -> Stream:
        self.llm.reset()   # generate() would otherwise reuse the KV cache of a shared prompt prefix
        stream = Stream(t_start=time.perf_counter(), token_ids=[])
        for token in self.llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            stream.times.append(time.perf_counter())
            stream.token_ids.append(token)
            if token in self.stop_ids or len(stream.token_ids) == max_tokens:
                break
        stream.n_tokens = len(stream.token_ids)
        return stream

    def decode(self, prompts: list[list[int]], max_tokens: int) -> list[Stream]:
        (prompt,) = prompts
        return [self._generate(prompt, max_tokens)]


class TransformersEngine:
    """Hugging Face transformers on torch CPU, the GGUF dequantized to fp32; a batch is one generate()
    call over left-padded prompts."""

    max_batch = 16

    def __init__(self, spec: dict[str, Any]) -> None:
        import os

        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(spec["threads"])
        self.torch = torch
        path = spec["model"]
        self.model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                          dtype=torch.float32).eval()
        self.stop_ids = spec["stop_ids"]
        self.devices = [f"torch cpu, {torch.get_num_threads()} threads"]

    def prefill(self, prompt: list[int]) -> tuple[float, float]:
        ids = self.torch.tensor([prompt])
        with self.torch.inference_mode():
            t0 = time.perf_counter()
            self.model(ids, logits_to_keep=1)
            prefill_s = time.perf_counter() - t0
        (stream,) = self.decode([prompt], 1)
        return stream.times[0] - stream.t_start, len(prompt) / prefill_s

    def decode(self, prompts: list[list[int]], max_tokens: int) -> list[Stream]:
        from transformers.generation.streamers import BaseStreamer

        torch, width = self.torch, max(len(p) for p in prompts)
        pad = self.stop_ids[0]
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        streams = [Stream(t_start=time.perf_counter(), token_ids=[]) for _ in prompts]
        stop_ids = set(self.stop_ids)

        class StepClock(BaseStreamer):
            """generate() calls put() with the prompt, then with each step's new token per sequence."""

            prompt_seen = False

            def put(self, value: Any) -> None:
                now = time.perf_counter()
                if not self.prompt_seen:
                    self.prompt_seen = True
                    return
                for stream, token in zip(streams, value.reshape(-1).tolist()):
                    if not stream.token_ids or stream.token_ids[-1] not in stop_ids:
                        stream.times.append(now)
                        stream.token_ids.append(token)

            def end(self) -> None:
                pass

        with torch.inference_mode():
            self.model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                                eos_token_id=self.stop_ids, pad_token_id=pad, streamer=StepClock())
        for stream in streams:
            stream.n_tokens = len(stream.token_ids)
        return streams


def open_engine(name: str, spec: dict[str, Any]) -> LSEEngine | LlamaCppEngine | TransformersEngine:
    if name == "lse":
        return LSEEngine(spec, spec.get("pool"))
    if name == "lse-cpu0":
        return LSEEngine(spec, "cpu:0")
    if name == "llama.cpp":
        return LlamaCppEngine(spec)
    if name == "transformers":
        return TransformersEngine(spec)
    raise ValueError(f"unknown engine {name!r}; one of {', '.join(ENGINES)}")


def run(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    engine = open_engine(name, spec)
    result: dict[str, Any] = {"load_s": time.perf_counter() - t0, "memory_after_load_mib": memory_mib(),
                              "devices": engine.devices}
    # Warm-up on prompts that share no prefix with the measured ones: compiles kernels, fills caches.
    engine.prefill(spec["warmup_prompt"])
    engine.decode(spec["warmup_decode_prompts"][: engine.max_batch], 4)

    result["ttft_s"], result["prefill_tps"] = engine.prefill(spec["prefill_prompt"])
    result["decode"] = {}
    for n in spec["concurrency"]:
        if n > engine.max_batch:
            continue
        max_tokens = spec["max_tokens_single"] if n == 1 else spec["max_tokens_batch"]
        streams = engine.decode(spec["decode_prompts"][:n], max_tokens)
        result["decode"][str(n)] = {"tps": decode_rate(streams), "tokens": [s.n_tokens for s in streams]}
        if n == 1:
            result["single_stream"] = {k: v for k, v in asdict(streams[0]).items() if k in ("token_ids", "text")}
    result["memory_mib"] = memory_mib()
    jit_cache = sys.modules.get("lse_backends.jit.cache")
    if jit_cache is not None:   # functions compiled here, not loaded from the disk cache: the peak RSS holds numba's
        result["jit_compiled"] = len(jit_cache.COMPILED)   # compile (the warm-up compiled before any timing)
    return result


def main() -> None:
    name, spec_path, out_path = sys.argv[1:4]
    with open(spec_path) as f:
        spec = json.load(f)
    try:
        result = run(name, spec)
    except EngineMissing as e:
        result = {"skipped": str(e)}
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
