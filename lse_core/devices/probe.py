"""A backend's devices, listed by a child process.

Listing OpenCL or CUDA devices loads the drivers' libraries (PoCL's LLVM, the CUDA runtime), and they
stay mapped for the life of the process: 78 MiB of a CPU-only engine's memory here, for devices it
then does not open. A backend that sets ``Backend.probe_in_child`` is listed by
``python -m lse_core.devices.probe GROUP NAME`` instead (as vLLM counts CUDA devices out of process):
the engine loads a driver only for a device it opens. A probe that crashes (a broken driver) declines
the backend's devices instead of taking the engine down.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from lse_core.devices.hookspec import DeviceInfo

TIMEOUT_S = 120  # a CUDA runtime's first initialization can take tens of seconds on a large machine


def start(group: str, name: str) -> subprocess.Popen:
    """Start listing backend ``name`` (of entry-point ``group``) in a child with this process's
    import path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "LSE_BACKENDS": name}
    return subprocess.Popen([sys.executable, "-m", __name__, group, name], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class ProbeFailed(RuntimeError):
    """The child crashed or hung; the message says which."""


def result(child: subprocess.Popen) -> list[DeviceInfo]:
    """The devices the child listed; ProbeFailed where it did not."""
    try:
        out, err = child.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise ProbeFailed(f"listing its devices took over {TIMEOUT_S} s") from None
    if child.returncode != 0:
        last = (err.strip().splitlines() or [f"exit status {child.returncode}"])[-1]
        raise ProbeFailed(f"listing its devices failed: {last}")
    return [DeviceInfo(**fields) for fields in json.loads(out)]


def main() -> None:
    from lse_core.devices.registry import discover

    group, name = sys.argv[1:]
    backend = discover(group, children=False).backends[name]
    print(json.dumps([dataclasses.asdict(info) for info in backend.devices()]))


if __name__ == "__main__":
    main()
