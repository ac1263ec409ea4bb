"""What one hostile request costs everyone else: while a huge prompt is sent to a real lse-server, a second
client polls GET /v1/models; its worst wait is the stall. Also the server's peak RSS and how long the huge
request took to be answered.

    python benchmarks/hostile.py                     # default model on jit:0
    python benchmarks/hostile.py -m model.gguf --pool cpu:0
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

BODY_BYTES = 7_900_000   # just under lse-server's 8 MiB body limit
WORD = "hello world "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cases() -> dict[str, tuple[str, dict]]:
    huge = WORD * (BODY_BYTES // len(WORD))
    return {
        "completion, 7.9 MB prompt": ("/v1/completions", {"prompt": huge, "max_tokens": 4}),
        "chat, 7.9 MB message": ("/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": huge}], "max_tokens": 4}),
        "completion, 320 KB prompt": ("/v1/completions", {"prompt": WORD * (320_000 // len(WORD)), "max_tokens": 4}),
        "tokenize, 7.9 MB": ("/tokenize", {"prompt": huge}),
        "embeddings, 7.9 MB": ("/v1/embeddings", {"input": huge}),
    }


def stall(base: str, path: str, body: dict) -> dict:
    data = json.dumps(body).encode()
    result: dict = {}

    def send() -> None:
        start = time.perf_counter()
        r = httpx.post(base + path, content=data, headers={"content-type": "application/json"}, timeout=300)
        result.update(status=r.status_code, seconds=round(time.perf_counter() - start, 3),
                      code=(r.json().get("error") or {}).get("code") if r.status_code != 200 else None)

    sender = threading.Thread(target=send)
    sender.start()
    worst = 0.0
    with httpx.Client(base_url=base, timeout=300) as client:
        while sender.is_alive():
            start = time.perf_counter()
            client.get("/v1/models")
            worst = max(worst, time.perf_counter() - start)
    sender.join()
    return result | {"worst_concurrent_wait_s": round(worst, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", help="model path (default: the default model)")
    parser.add_argument("--pool", default="jit:0")
    args = parser.parse_args()
    port = free_port()
    command = [str(Path(sys.executable).parent / "lse-server"), "--port", str(port), "--pool", args.pool]
    server = subprocess.Popen(command + (["-m", args.model] if args.model else []), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None:
                sys.exit("lse-server exited")
            time.sleep(0.2)
        rss_idle = peak_rss(server.pid)
        for name, (path, body) in cases().items():
            print(f"{name:28} {stall(base, path, body)}", flush=True)
        print(f"server peak RSS: {rss_idle} MiB after loading, {peak_rss(server.pid)} MiB at the end")
    finally:
        server.terminate()
        server.wait(30)


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) // 1024
    raise RuntimeError("no VmHWM")


if __name__ == "__main__":
    main()
