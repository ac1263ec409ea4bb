"""What a long prompt or a big embeddings request costs the streams already running: a real lse-server streams
8 greedy completions while 4k-token prompts arrive one after another, then one embeddings request of
thousands of inputs; each stream's inter-token gaps are timed as its SSE events arrive.

    python benchmarks/stream_gaps.py                  # default model, default devices
    python benchmarks/stream_gaps.py --pool jit:0 --long-prompts 3 --embeddings 4000

Reports, for each phase (the streams alone, each long prompt, the embeddings request): the largest gap any
of the streams saw, the p99 of their gaps, and the long prompt's time to first token (or the embeddings
request's time to answer). The goal (issue 49) is a largest gap of at most 0.5 s.

The disturbing requests' bodies are serialized beforehand and their answers parsed after the run, so the
client's own work (a 4,000-vector JSON) does not delay the stream readers' clocks.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np


@dataclass
class Phase:
    """A time window of the run: what was sent in it and how long its answer took."""

    name: str
    start: float
    end: float = 0.0
    answer_s: float = 0.0            # time to first token (long prompt) or to the answer (embeddings)
    status: int = 0


@dataclass
class Stream:
    times: list[float] = field(default_factory=list)   # arrival of each token event


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [str(Path(sys.executable).parent / "lse-server"), "--port", str(port),
               "--parallel", str(args.streams + 8)]
    command += ["-m", args.model] if args.model else []
    command += ["--pool", args.pool] if args.pool else []
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(base + "/health").status_code == 200:
                return server, base
        except httpx.TransportError:
            pass
        if server.poll() is not None:
            sys.exit("lse-server exited")
        time.sleep(0.2)


def read_stream(base: str, i: int, stream: Stream, stop: threading.Event) -> None:
    """Stream a long greedy completion, timing each token event, until ``stop`` is set."""
    body = {"prompt": f"Chapter {i}. Once upon a time", "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stream.times.append(time.perf_counter())
            if stop.is_set():
                return


def timed_post(base: str, path: str, data: bytes, phase: Phase, first_event: bool) -> bytes:
    """POST pre-serialized ``data``; the phase's answer_s is the time to the first SSE event (``first_event``)
    or to the whole answer. The answer's bytes come back unparsed."""
    start = time.perf_counter()
    with httpx.stream("POST", base + path, content=data, headers={"content-type": "application/json"},
                      timeout=600) as r:
        phase.status = r.status_code
        if first_event:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    phase.answer_s = time.perf_counter() - start
                    return b""
        body = r.read()
    phase.answer_s = time.perf_counter() - start
    return body


def gaps_in(streams: list[Stream], start: float, end: float) -> tuple[np.ndarray, np.ndarray]:
    """Every inter-token gap of every stream whose later token arrived in [start, end], and when it began."""
    gaps, began = [np.empty(0)], [np.empty(0)]
    for s in streams:
        t = np.asarray(s.times)
        inside = (t[1:] >= start) & (t[1:] <= end)
        gaps.append(np.diff(t)[inside])
        began.append(t[:-1][inside])
    return np.concatenate(gaps), np.concatenate(began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", help="model path (default: the default model)")
    parser.add_argument("--pool", help="devices (default: the server's)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--long-prompts", type=int, default=2, help="4k-token prompts sent one after another")
    parser.add_argument("--prompt-tokens", type=int, default=3800)
    parser.add_argument("--embeddings", type=int, default=4000, help="inputs of the embeddings request (0: none)")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds of streams alone before and after")
    args = parser.parse_args()

    rng = random.Random(0)
    # random ids well inside the vocabulary, different for each prompt, so the prefix cache never helps
    long_bodies = [json.dumps({"prompt": [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)],
                               "max_tokens": 1, "stream": True}).encode() for _ in range(args.long_prompts)]
    embeddings_body = json.dumps({"input": [f"Sentence {i} is about the number {i * 7919 % 10007}."
                                            for i in range(args.embeddings)]}).encode()

    server, base = start_server(args)
    try:
        httpx.post(base + "/v1/completions", json={"prompt": "warm up", "max_tokens": 8}, timeout=600)
        streams = [Stream() for _ in range(args.streams)]
        stop = threading.Event()
        readers = [threading.Thread(target=read_stream, args=(base, i, s, stop)) for i, s in enumerate(streams)]
        for t in readers:
            t.start()
        while not all(len(s.times) >= 5 for s in streams):
            time.sleep(0.05)
        phases = [Phase("streams alone", time.perf_counter())]
        time.sleep(args.settle)
        for i, body in enumerate(long_bodies):
            phases[-1].end = time.perf_counter()
            phases.append(Phase(f"{args.prompt_tokens}-token prompt {i + 1}", time.perf_counter()))
            timed_post(base, "/v1/completions", body, phases[-1], first_event=True)
        answer = b""
        if args.embeddings:
            phases[-1].end = time.perf_counter()
            phases.append(Phase(f"embeddings, {args.embeddings} inputs", time.perf_counter()))
            answer = timed_post(base, "/v1/embeddings", embeddings_body, phases[-1], first_event=False)
        phases[-1].end = time.perf_counter()
        time.sleep(args.settle)
        stop.set()
        for t in readers:
            t.join()
        if args.embeddings and phases[-1].status == 200:
            assert len(json.loads(answer)["data"]) == args.embeddings
    finally:
        server.terminate()
        server.wait(30)

    print(f"{args.streams} streams; gaps between token events, in seconds")
    print(f"{'phase':34} {'largest':>8} {'p99':>7} {'median':>7} {'answer':>8} status  largest gap began at")
    for p in phases:
        gaps, began = gaps_in(streams, p.start, p.end)
        if not len(gaps):
            print(f"{p.name:34} (no tokens arrived)")
            continue
        answer_s = f"{p.answer_s:8.2f}" if p.answer_s else f"{'':8}"
        print(f"{p.name:34} {gaps.max():8.3f} {np.percentile(gaps, 99):7.3f} {np.median(gaps):7.3f} {answer_s} "
              f"{p.status or '':6}  {began[gaps.argmax()] - p.start:.2f} s of {p.end - p.start:.2f} s")
    disturbed, _ = gaps_in(streams, phases[1].start if len(phases) > 1 else phases[0].start, phases[-1].end)
    if len(disturbed):
        print(f"while disturbed: largest gap {disturbed.max():.3f} s, p99 {np.percentile(disturbed, 99):.3f} s "
              f"(goal: largest <= 0.5 s)")


if __name__ == "__main__":
    main()
