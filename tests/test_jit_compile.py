"""jit:0's compiles on a cold cache: each stage is reported while it runs (a log line at its start and
end, a bar on a terminal), recorded in cache.COMPILED, silent once cached; and importing the backend
compiles none of the program's kernels, which wait for a program to run on jit:0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

COMPILE_A_GROUP = """
import json, logging, sys
logging.basicConfig(level="WARNING", format="%(message)s", stream=sys.stderr)
from lse_backends.jit import cache, codegen, program
from lse_core.graph.fuse import FusedGroup
from lse_core.graph.ir import Node
group = FusedGroup(0, (Node("silu", ("x",), "a"), Node("mul", ("a", "y"), "b")), ("x", "y"), ("b",), ())
codegen.compile_elementwise(group)
print(json.dumps({"compiled": [c.name for c in cache.COMPILED], "work": len(program._work.signatures)}))
"""


def run_cold(tmp_path: Path) -> tuple[dict, list[str]]:
    """COMPILE_A_GROUP in a new process whose numba cache and generated sources live under tmp_path."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]), NUMBA_CACHE_DIR=str(tmp_path / "numba"),
               LSE_JIT_CACHE=str(tmp_path / "generated"))
    result = subprocess.run([sys.executable, "-c", COMPILE_A_GROUP], env=env, capture_output=True, text=True,
                            check=True, timeout=600)
    return json.loads(result.stdout), [line for line in result.stderr.splitlines() if "jit:0 compil" in line]


def test_compiling_is_reported_per_stage_and_recorded_then_silent_once_cached(tmp_path):
    first, lines = run_cold(tmp_path)
    assert "fused.fused" in first["compiled"]
    group_lines = [line for line in lines if "a fused group of silu, mul" in line]
    assert group_lines[0].startswith("lse: jit:0 compiling a fused group of silu, mul (a first run")
    assert group_lines[1].startswith("lse: jit:0 compiled a fused group of silu, mul: 1 functions in ")
    assert len(group_lines) == 2

    second, lines = run_cold(tmp_path)
    assert second["compiled"] == [] and lines == []   # everything loaded from the cache


def test_importing_the_backend_compiles_none_of_the_programs_kernels(tmp_path):
    """A pool without jit:0 still imports it (every backend is listed): its minute of program kernels
    (program._work, the quantized linears, attention) must wait for a program to run."""
    first, _ = run_cold(tmp_path)
    assert first["work"] == 0
    assert not [name for name in first["compiled"] if name.startswith(("quant.", "attention.", "program._work"))]



COMPILE_THE_KERNELS = """
import json, logging, os, sys
logging.basicConfig(level="WARNING", format="%(message)s", stream=sys.stderr)
if os.environ.get("BROKEN_SECOND_PROCESS"):
    sys.executable = "/bin/false"   # the second process exits 1 at once
from lse_backends.jit import cache, program, quant
program.compiled_kernels(quant.kinds_mask(["Q4_1", "Q8_0"]))
print(json.dumps({"compiled": [c.name for c in cache.COMPILED]}))
"""


def compile_the_kernels(tmp_path: Path, **env: str) -> tuple[list[str], list[str]]:
    """COMPILE_THE_KERNELS as `lse` runs from a checkout with the package installed: the working directory
    holds another copy of the package (here a broken one), which neither process may import."""
    checkout = tmp_path / "checkout"
    (checkout / "lse_backends").mkdir(parents=True, exist_ok=True)
    (checkout / "lse_backends" / "__init__.py").write_text("raise ImportError('the working directory's copy')\n")
    environ = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]), NUMBA_CACHE_DIR=str(tmp_path / "numba"),
                   LSE_JIT_CACHE=str(tmp_path / "generated"), **env)
    result = subprocess.run([sys.executable, "-P", "-c", COMPILE_THE_KERNELS], env=environ, capture_output=True,
                            text=True, check=True, timeout=600, cwd=checkout)
    return json.loads(result.stdout)["compiled"], [line for line in result.stderr.splitlines() if "jit:0" in line]


def test_a_cold_compile_shares_the_kernels_with_a_second_process_and_does_its_share_should_it_fail(tmp_path):
    """Two processes compile a cold cache's kernels at once (numba compiles under one lock per process); this
    one loads the other's from the disk cache. Should the other fail, this one compiles them and says why."""
    from lse_backends.jit import program, quant

    compiled, lines = compile_the_kernels(tmp_path)
    linear_pairs = quant.linear_pairs_for(quant.kinds_mask(["Q4_1", "Q8_0"])).__name__
    second = {f"quant.{linear_pairs}" if n == "linear_pairs" else f"attention.{n}" for n in program.SECOND_PROCESS}
    second.add("sampling.sample")
    assert {"program._work", "program._run", "program.execute"} <= set(compiled)
    if len(os.sched_getaffinity(0)) == 1:   # one core: no second process, all compiled here
        assert second - {"sampling.sample"} <= set(compiled) and not any("second process" in line for line in lines)
        return
    assert not second & set(compiled)
    assert any(line.startswith(f"lse: jit:0 compiled {program.SECOND_SHARE} in the second process")
               for line in lines)

    second.discard("sampling.sample")   # compiled at a step's first sampling, which this test does not make
    for path in (tmp_path / "numba").rglob("*"):   # forget the second process's kernels only
        if path.is_file() and any(name.split(".")[1] in path.name for name in second):
            path.unlink()
    compiled, lines = compile_the_kernels(tmp_path, BROKEN_SECOND_PROCESS="1")
    assert second <= set(compiled) and "program._work" not in compiled   # the rest loads from the cache
    assert any("the second compile process failed (exit 1)" in line for line in lines)


RUN_THEN_REPORT_LLVM = """
import json
from pathlib import Path
from lse_core.api import lse_close, lse_open_or_raise, lse_request_iter
from lse_core.config import LSEConfig

def llvm_resident_kib():
    kib, in_llvm = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            in_llvm = len(fields) > 5 and "libllvmlite" in fields[5]
        elif fields[0] == "Rss:" and in_llvm:
            kib += int(fields[1])
    return kib

def answer(lse):
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    events = list(lse_request_iter(lse, body, "completion"))
    assert events[-1].kind == "end", events[-1].data
    return events[-1].data["choices"][0]["text"]

lse = lse_open_or_raise(LSEConfig(pool="jit:0"))
first = answer(lse)
after_first_run = llvm_resident_kib()
from numba import njit   # a compile after the release: LLVM's pages come back as it needs them
assert njit(lambda a: a * 3 + 1)(2) == 7
print(json.dumps({"first": first, "again": answer(lse), "kib": after_first_run}))
lse_close(lse)
"""


def test_llvms_code_leaves_the_resident_set_once_the_program_has_run():
    """LLVM (llvmlite's library, tens of MiB resident after compiling or loading the kernels) is not needed
    to run them: after a program's first run its pages are handed back (cache.release_compiler_pages), the
    next request gives the same answer, and a later compile still works."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
    result = subprocess.run([sys.executable, "-c", RUN_THEN_REPORT_LLVM], env=env, capture_output=True, text=True,
                            check=True, timeout=900)
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["first"] == report["again"] and report["first"].strip()
    assert report["kib"] < 16 * 1024, report
