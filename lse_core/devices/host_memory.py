"""Host memory for buffers that fill in slowly, like KV caches: sized for every slot and position, but
resident only where written; for weights that every step streams, in 2 MiB pages; and the heap's freed
memory handed back to the OS."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap

import numpy as np


def sparse_zeros(shape: tuple[int, ...], dtype: np.dtype | type = np.float32) -> np.ndarray:
    """A zeroed array whose pages the OS commits one 4 KiB page at a time, as they are first written.
    np.zeros commits lazily too, but numpy asks for transparent huge pages on arrays of 4 MiB and more,
    so one written position commits 2 MiB: sixteen KV slots of a few tokens each would commit most of
    the cache. An anonymous mapping advised MADV_NOHUGEPAGE commits what is written."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes == 0:
        return np.zeros(shape, dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(pages, dtype).reshape(shape)  # the array keeps the mapping alive


HUGE_PAGE = 2 << 20      # x86-64's transparent huge page
ARENA_BYTES = 64 << 20   # one mapping of HugePageArena, which arrays of this size and more get to themselves
ALIGN = 64               # a cache line: where each array of an arena starts


def huge_pages(nbytes: int) -> np.ndarray:
    """``nbytes`` bytes (uint8), rounded up to whole huge pages, of a private anonymous mapping that starts on
    a huge page boundary and is advised MADV_HUGEPAGE (numpy advises only arrays of 4 MiB and more, from
    wherever malloc put them, so their ends stay in 4 KiB pages, and smaller ones are 4 KiB pages throughout).
    The array keeps the mapping alive."""
    size = -(-max(nbytes, 1) // HUGE_PAGE) * HUGE_PAGE
    pages = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(pages, np.uint8)
    skip = -whole.ctypes.data % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
        pages.madvise(mmap.MADV_HUGEPAGE, skip, size)
    return whole[skip:skip + size]


class HugePageArena:
    """Arrays packed one after another (each at a cache line) into huge pages (``huge_pages``): a device's
    layouts of the weights, which a decode step streams from memory. On a VM each 4 KiB page costs the
    stream a nested page walk, and the hardware prefetchers stop at every 4 KiB boundary: on the 2-core
    Xeon, one thread streaming 7 Q4_K matrices of 8192 x 2048 (9.7 MB each, mostly in the huge pages numpy
    asked for) ran at 7.8-8.6 GB/s, the same matrices in one arena at 11.4-11.7. A mapping's unused tail
    is never touched, so it is never resident."""

    def __init__(self) -> None:
        self._free = np.empty(0, np.uint8)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype | type = np.uint8) -> np.ndarray:
        """An uninitialized C-contiguous array in the arena."""
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        if nbytes >= ARENA_BYTES:
            return huge_pages(nbytes)[:nbytes].view(dtype).reshape(shape)
        if nbytes > self._free.nbytes:
            self._free = huge_pages(ARENA_BYTES)
        array = self._free[:nbytes].view(dtype).reshape(shape)
        self._free = self._free[-(-nbytes // ALIGN) * ALIGN:]
        return array


def release_file_pages(array: np.ndarray) -> None:
    """Drop the whole pages under ``array`` from this process's resident set where it is a view of a read-only
    memory-mapped file (a GGUF's weights): they stay in the page cache, and a later read faults them back in.
    A device laying a large weight out calls this as it goes, so that the file's pages and the layout are not
    resident together at the peak (Gemma 3 270M's 262k x 640 embedding). Anything else is left alone: a
    writable mapping's pages may hold data nowhere else."""
    if not hasattr(mmap, "MADV_DONTNEED"):
        return
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):   # np.frombuffer's base
        base = base.obj
    if not isinstance(base, mmap.mmap) or base.closed or not memoryview(base).readonly:
        return
    start = array.ctypes.data - np.frombuffer(base, np.uint8).ctypes.data
    first, end = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, (start + array.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > first:
        base.madvise(mmap.MADV_DONTNEED, first, end - first)


@functools.cache
def libc_function(name: str, argtypes: tuple, restype: type) -> ctypes._CFuncPtr | None:
    """The C library's function ``name`` with its signature set, or None where it has none (malloc_trim
    outside glibc, madvise outside POSIX)."""
    try:
        function = getattr(ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = argtypes, restype
    return function


def release_freed_heap() -> None:
    """Hand the C heap's free memory back to the OS (glibc's malloc_trim). glibc keeps what a large burst of
    small allocations freed: building a tokenizer of a 262k vocabulary from its JSON (tokenizers) leaves
    ~300 MiB so, resident for the life of the process. Elsewhere this does nothing."""
    trim = libc_function("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)
    if trim is not None:
        trim(0)


# glibc's mallopt parameter, and the size from which C heap blocks are mapped on their own
M_MMAP_THRESHOLD = -3
LARGE_BLOCK = 4 << 20


def return_large_blocks() -> None:
    """Have the C heap map every block of LARGE_BLOCK bytes and more on its own, handed back to the OS when
    freed (glibc's M_MMAP_THRESHOLD, fixed). glibc's own threshold rises to the largest block freed, so after
    the first a step's logits (16 sequences of a 262k vocabulary: 16 MiB) and its other temporaries come from
    the heap, and stay resident once freed, in each thread's arena: over benchmarks/memory.py's workload Gemma
    3 270M's RSS grew 480 -> 693 MiB, with this 524 -> 553. Elsewhere this does nothing."""
    mallopt = libc_function("mallopt", (ctypes.c_int, ctypes.c_int), ctypes.c_int)
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK)
