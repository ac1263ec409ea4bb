"""Build and install llama-cpp-python, the benchmarks' llama.cpp, with the CMake flags this CPU needs.

    python benchmarks/install_llama_cpp.py [--print-flags] [--avx2-only DIR]

llama.cpp builds from source (several minutes on two cores, run under ``nice``); the wheel is kept in
~/.cache/lse-wheels, so a reinstall takes seconds. A native build (GGML_NATIVE) is right on most CPUs, but
on a Xeon with AMX it enables AMX_INT8, which segfaults at the first compute in these VMs: there the
flags name the AVX-512 extensions the CPU has and leave AMX off (shared/DESIGN.md).

``--avx2-only DIR`` builds llama.cpp with a Zen 3's instruction sets alone (AVX, AVX2, FMA, F16C) into DIR,
beside the installed one: on an AVX-512 machine, ``LSE_JIT_ISA=avx2 PYTHONPATH=DIR python
benchmarks/compare.py ...`` then compares both engines' AVX2 code on the same hardware.
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
AVX2_ONLY = {"avx", "avx2", "fma", "f16c"}   # the cpuinfo flags of X86_OPTIONS that a Zen 3 has


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cmake_args(flags: set[str], avx2_only: bool = False) -> str:
    """Native, unless the CPU has AMX or ``avx2_only`` asks for AVX2's level alone: then each x86 extension
    it has (of those), by name, and AMX off."""
    if avx2_only:
        flags = flags & AVX2_ONLY
    elif not any(f.startswith("amx") for f in flags):
        return "-DGGML_NATIVE=ON"
    options = [f"-D{option}={'ON' if flag in flags else 'OFF'}" for flag, option in X86_OPTIONS.items()]
    return " ".join(["-DGGML_NATIVE=OFF", *options, "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_TILE=OFF",
                     "-DGGML_AMX_BF16=OFF"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--print-flags", action="store_true", help="print the CMAKE_ARGS for this CPU and exit")
    p.add_argument("--avx2-only", metavar="DIR", help="build with AVX2's instruction sets alone and install "
                   "into DIR (for PYTHONPATH), leaving the installed llama-cpp-python as it is")
    args = p.parse_args(argv)
    flags = cmake_args(cpu_flags(), avx2_only=bool(args.avx2_only))
    if args.print_flags:
        print(flags)
        return 0
    env = dict(os.environ, CMAKE_ARGS=flags)
    print(f"CMAKE_ARGS={flags}", file=sys.stderr)
    wheels = WHEELS / "avx2" if args.avx2_only else WHEELS
    pip = [sys.executable, "-m", "pip"]
    # --no-cache-dir: pip's own wheel cache is keyed by the source, not CMAKE_ARGS, and would hand back a
    # wheel built with other flags
    wheel = ["wheel", "--no-cache-dir", f"llama-cpp-python=={VERSION}", "-w", str(wheels), "--find-links",
             str(wheels), "--no-deps"]
    subprocess.run(["nice", *pip, *wheel], env=env, check=True)   # a wheel already built is reused
    target = ["--no-deps", "--target", args.avx2_only] if args.avx2_only else []
    subprocess.run([*pip, "install", "--find-links", str(wheels), *target, f"llama-cpp-python=={VERSION}"],
                   check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
