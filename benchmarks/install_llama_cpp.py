"""Build and install llama-cpp-python, the benchmarks' llama.cpp, with the CMake flags this CPU needs.

    python benchmarks/install_llama_cpp.py [--print-flags]

llama.cpp builds from source (several minutes on two cores, run under ``nice``); the wheel is kept in
~/.cache/lse-wheels, so a reinstall takes seconds. A native build (GGML_NATIVE) is right on most CPUs, but
on a Xeon with AMX it enables AMX_INT8, which segfaults at the first compute in these VMs: there the
flags name the AVX-512 extensions the CPU has and leave AMX off (shared/DESIGN.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

VERSION = "0.3.36"
WHEELS = Path.home() / ".cache" / "lse-wheels"
# cpuinfo flag -> the GGML option that uses it, for a non-native build
X86_OPTIONS = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C",
               "avx512f": "GGML_AVX512", "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16",
               "avx_vnni": "GGML_AVX_VNNI"}


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cmake_args(flags: set[str]) -> str:
    """Native, unless the CPU has AMX: then each x86 extension it has, by name, and AMX off."""
    if not any(f.startswith("amx") for f in flags):
        return "-DGGML_NATIVE=ON"
    options = [f"-D{option}={'ON' if flag in flags else 'OFF'}" for flag, option in X86_OPTIONS.items()]
    return " ".join(["-DGGML_NATIVE=OFF", *options, "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_TILE=OFF",
                     "-DGGML_AMX_BF16=OFF"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--print-flags", action="store_true", help="print the CMAKE_ARGS for this CPU and exit")
    args = p.parse_args(argv)
    flags = cmake_args(cpu_flags())
    if args.print_flags:
        print(flags)
        return 0
    env = dict(os.environ, CMAKE_ARGS=flags)
    print(f"CMAKE_ARGS={flags}", file=sys.stderr)
    pip = [sys.executable, "-m", "pip"]
    wheel = ["wheel", f"llama-cpp-python=={VERSION}", "-w", str(WHEELS), "--find-links", str(WHEELS), "--no-deps"]
    subprocess.run(["nice", *pip, *wheel], env=env, check=True)   # a wheel already built is reused
    subprocess.run([*pip, "install", "--find-links", str(WHEELS), f"llama-cpp-python=={VERSION}"],
                   check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
