"""Aggregate throughput of lse-server --replicas 1 against --replicas 2 on a local Ray instance, and against a
plain lse-server (one engine in its process: what the Ray ingress costs).

    python benchmarks/ray_replicas.py --rounds 3                      # default model, jit:0, 8 clients
    python benchmarks/ray_replicas.py -m ./tiny-model --pool cpu:0 --clients 4 --json out.json

The three servers run at once, each Ray one on its own local Ray instance, and take turns each round, so a noisy minute
lands on both. Each turn, --clients clients send raw completions (distinct prompts, greedy, ignore_eos, so every
reply is --max-tokens long) for --seconds; throughput is the reply tokens of the requests that finished in the
window over the window. Every replica gets one Ray CPU and NUMBA_NUM_THREADS=OPENBLAS_NUM_THREADS=1 (the default
of --threads), so two replicas use two cores where one uses one: the ratio is what a second replica's core buys.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

READY_TIMEOUT_S = 900   # Ray, then replicas that may compile the jit kernels cold


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def replicas_server(args: argparse.Namespace, replicas: int) -> Iterator[str]:
    port = free_port()
    command = [sys.executable, "-m", "lse_http.server", "--replicas", str(replicas), "--port", str(port),
               "--parallel", str(args.parallel), *(["-m", args.model] if args.model else []),
               *(["--pool", args.pool] if args.pool else [])]
    threads = str(args.threads)
    env = {**os.environ, "NUMBA_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads, "OMP_NUM_THREADS": threads}
    log = tempfile.NamedTemporaryFile("w+", prefix=f"lse-ray-{replicas}-", suffix=".log", delete=False)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready(url, replicas):
            if process.poll() is not None or time.monotonic() > deadline:
                log_tail = Path(log.name).read_text()[-3000:]
                raise SystemExit(f"lse-server --replicas {replicas} did not start:\n{log_tail}")
            time.sleep(2)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(90)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def ready(url: str, replicas: int) -> bool:
    try:
        status = httpx.get(f"{url}/v1/lse/status", timeout=5)
        return status.status_code == 200 and len(status.json().get("replicas", [])) == replicas
    except (httpx.HTTPError, ValueError, KeyError):
        return False


def throughput(url: str, args: argparse.Namespace, turn: int) -> float:
    """Reply tokens per second over --seconds of --clients clients sending requests back to back."""
    tokens: list[int] = []
    start = time.monotonic()
    end = start + args.seconds

    def client(index: int) -> None:
        with httpx.Client(base_url=url, timeout=600) as http:
            n = 0
            while time.monotonic() < end:
                prompt = f"Request {turn}.{index}.{n}: the history of the printing press, told in order."
                reply = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": args.max_tokens,
                                                          "temperature": 0, "ignore_eos": True})
                reply.raise_for_status()
                if time.monotonic() <= end:
                    tokens.append(reply.json()["usage"]["completion_tokens"])
                n += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(tokens) / args.seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", help="model path (default: the default model)")
    p.add_argument("--pool", default="jit:0", help="each replica's pool (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--parallel", type=int, default=4, help="each replica's --parallel (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seconds", type=float, default=30.0, help="each turn's measured window")
    p.add_argument("--threads", type=int, default=1, help="NUMBA/OPENBLAS/OMP threads per replica")
    p.add_argument("--json", help="write every round's figures here")
    args = p.parse_args()
    rounds: list[dict[str, float]] = []
    with replicas_server(args, 0) as plain, replicas_server(args, 1) as one, replicas_server(args, 2) as two:
        for turn in range(args.rounds + 1):   # turn 0 warms them up and is not counted
            figures = {"lse-server": throughput(plain, args, turn), "1 replica": throughput(one, args, turn),
                       "2 replicas": throughput(two, args, turn)}
            if turn:
                rounds.append(figures)
                print(f"round {turn}: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in figures.items()), flush=True)
    summary: dict[str, Any] = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    for name, over, under in (("2 replicas / 1 replica", "2 replicas", "1 replica"),
                              ("1 replica / lse-server", "1 replica", "lse-server")):
        ratios = [r[over] / r[under] for r in rounds]
        summary[name] = statistics.median(ratios)
        print(f"{name}: {summary[name]:.2f} (rounds: {', '.join(f'{r:.2f}' for r in ratios)})")
    print("median tok/s: " + ", ".join(f"{k} {summary[k]:.1f}" for k in rounds[0]))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rounds": rounds, "median": summary}, indent=2))


if __name__ == "__main__":
    main()
