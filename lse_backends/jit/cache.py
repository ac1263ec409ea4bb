"""numba's disk cache for the jit device, keyed by all of the device's sources.

numba keys a function's cached machine code by its own file only (a hash of it, or its time stamp in
older releases), but compiles every @njit function it calls into the caller's code: ``execute`` in
program.py holds the kernels of the other files (quant.py, attention.py...), and a generated elementwise
function holds kernels.expf. Edit one of those files and the callers' cached code would go on running the
old kernels, on data laid out the new way. So every function cached from this package's directory, or from
the directory of generated sources, is stamped with its own file and every source file of this package.

A cold cache means half a minute or more of compiling on two cores; ``CompileBeside`` lets a second process
take part of it. ``CompileMonitor`` follows numba's compile events, so that nothing compiles in silence:
each outermost compile of this package's functions is a stage, shown while it runs as a tqdm bar on a
terminal (the functions compiled so far and the one compiling now) and logged as a line when it starts and
ends (a server's log), and every function compiled is recorded in ``COMPILED``. Loads from the cache raise
no compile event, so a warm start shows nothing. Once a stage has compiled, and once a program has first run
(its kernels compiled or loaded), ``release_compiler_pages`` hands LLVM's code back to the page cache.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from numba.core import caching, event
from numba.core.caching import _CacheLocator
from tqdm import tqdm

from lse_core.devices.host_memory import libc_function

from . import vector

_CacheImpl = getattr(caching, "CacheImpl", None) or caching._CacheImpl  # renamed in numba 0.6x

PACKAGE = Path(__file__).resolve().parent
log = logging.getLogger("lse")


def generated_sources() -> Path:
    """Where generated sources (and numba's cache beside them) live: $LSE_JIT_CACHE, else ~/.cache/lse/jit."""
    return Path(os.environ.get("LSE_JIT_CACHE") or Path.home() / ".cache" / "lse" / "jit")


def package_stamp() -> str:
    """A hash of every source file of this package: any edit to one gives a new stamp."""
    return _hash(tuple((path, path.stat().st_mtime_ns, path.stat().st_size) for path in sorted(PACKAGE.glob("*.py"))))


@functools.cache
def _hash(files: tuple[tuple[Path, int, int], ...]) -> str:
    """The hash of these files' names and contents (memoized by their time stamps and sizes, as numba's)."""
    digest = hashlib.sha256()
    for path, _, _ in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


class PackageLocator(_CacheLocator):
    """The locator numba would choose for a file (``inner``: where the cache lives, which function is
    which), stamped with that file's own stamp and the package's, its entries named apart per instruction
    set (``vector.ISA``)."""

    def __init__(self, inner: _CacheLocator) -> None:
        self.inner = inner
        self._py_file = inner._py_file   # numba's warning for a function it cannot cache names the file

    def ensure_cache_path(self) -> None:
        self.inner.ensure_cache_path()

    def get_cache_path(self) -> str:
        return self.inner.get_cache_path()

    def get_source_stamp(self) -> tuple:
        return self.inner.get_source_stamp(), package_stamp()

    def get_disambiguator(self) -> str:
        # numba keys machine code by the host CPU; the kernels' instruction set can be another (LSE_JIT_ISA)
        return f"{self.inner.get_disambiguator()}-{vector.ISA}"

    @classmethod
    def from_function(cls, py_func: Callable, py_file: str) -> PackageLocator | None:
        if Path(py_file).resolve().parent not in (PACKAGE, generated_sources().resolve()):
            return None
        for other in _CacheImpl._locator_classes:
            if other is not cls and (inner := other.from_function(py_func, py_file)) is not None:
                return cls(inner)
        return None


@dataclass(frozen=True)
class Compiled:
    """One function numba compiled in this process (not loaded from its cache)."""

    name: str        # module.qualname, relative to this package (``quant.linear_pairs``)
    signature: str   # the argument types it was compiled for
    seconds: float   # from its start to its end, the functions it compiled on the way included


COMPILED: list[Compiled] = []


def _name(dispatcher) -> str | None:
    """A dispatcher's name relative to this package (generated sources: ``fused``), or None for another's."""
    module, qualname = dispatcher.py_func.__module__ or "", dispatcher.py_func.__qualname__   # exec'd code: None
    if module.startswith(__package__ + "."):
        return f"{module.removeprefix(__package__ + '.')}.{qualname}"
    if module.startswith("lse_jit_fused_"):   # codegen's generated elementwise functions
        return f"fused.{qualname}"
    return None


class CompileMonitor(event.Listener):
    """numba compile events -> COMPILED, and per stage a bar on a terminal and a log line at its start and
    end. A stage is what ``stage`` encloses, else one outermost compile of this package's functions; it
    begins at its first compile, so a stage that loads everything from the cache shows nothing."""

    def __init__(self) -> None:
        self.starts: list[tuple[str | None, float]] = []   # the compiles under way, outermost first
        self.label: str | None = None    # the enclosing ``stage``'s, or the outermost compile's
        self.bar: tqdm | None = None     # while a stage compiles
        self.compiling = ""              # that stage's label
        self.began = 0.0
        self.functions = 0               # of this package, compiled in the stage

    @contextmanager
    def stage(self, label: str) -> Iterator[None]:
        """Report the compiles inside as one stage called ``label`` (inside another stage: part of it)."""
        if self.label is not None:
            yield
            return
        self.label = label
        try:
            yield
        finally:
            self.label = None
            self._end()

    def on_start(self, ev: event.Event) -> None:
        name = _name(ev.data["dispatcher"])
        if not self.starts and name is not None and self.bar is None:
            label = self.label or name
            log.warning("lse: jit:0 compiling %s (a first run for this CPU and these sources; cached for the next)",
                        label)
            self.bar = tqdm(desc=f"jit:0 compiling {label}", unit=" functions", disable=None, leave=False)
            self.label, self.compiling, self.began, self.functions = label, label, time.perf_counter(), 0
        self.starts.append((name, time.perf_counter()))
        if self.bar is not None and name is not None:
            self.bar.set_postfix_str(name, refresh=True)

    def on_end(self, ev: event.Event) -> None:
        name, started = self.starts.pop()
        if name is not None:
            COMPILED.append(Compiled(name, str(ev.data.get("args")), time.perf_counter() - started))
            self.functions += 1
            if self.bar is not None:
                self.bar.update()
        if not self.starts and self.label == name:   # a stage of one outermost compile
            self.label = None
            self._end()

    def _end(self) -> None:
        if self.bar is None:
            return
        self.bar.close()
        self.bar = None
        log.warning("lse: jit:0 compiled %s: %d functions in %.1f s", self.compiling, self.functions,
                    time.perf_counter() - self.began)
        release_compiler_pages()


_MONITOR = CompileMonitor()
stage = _MONITOR.stage


def install() -> None:
    """Have numba locate this package's caches (and generated sources') through PackageLocator, and
    report its compiles through CompileMonitor."""
    if PackageLocator not in _CacheImpl._locator_classes:
        _CacheImpl._locator_classes.insert(0, PackageLocator)
        event.register("numba:compile", _MONITOR)


def is_cached(dispatcher, signature) -> bool:
    """Whether compiling ``dispatcher`` for ``signature`` would load it from the disk cache: its index holds
    the signature for these sources and this CPU (numba's own lookup, without loading the code)."""
    store = dispatcher._cache
    return store._index_key(signature, dispatcher.targetctx.codegen()) in store._cache_file._load_index()


class CompileBeside:
    """A second Python process that runs ``call``, code that compiles ``what`` into the disk cache, while this
    one goes on (loading the model, compiling the rest): numba compiles under one lock per process, so two
    processes are what use two cores. ``join`` waits for it; should it fail, it says why, and what it was to
    compile compiles here when it is next asked for (its cache entries are missing)."""

    def __init__(self, call: str, what: str) -> None:
        log.warning("lse: jit:0 compiling %s in a second process meanwhile", what)
        self.what, self.began = what, time.perf_counter()
        self.errors = tempfile.TemporaryFile()
        # this process's copy of the package first (an empty entry would put the working directory on the path),
        # and -P: ``-c`` would put the working directory before it, and run a checkout there instead of the
        # installed package, whose cache entries this process would never find (it then compiled all of them)
        path = os.pathsep.join(p for p in (str(PACKAGE.parent.parent), os.environ.get("PYTHONPATH")) if p)
        self.child = subprocess.Popen([sys.executable, "-P", "-c", call], stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=self.errors,
                                      env=os.environ | {"PYTHONPATH": path})

    def join(self) -> None:
        code = self.child.wait()
        self.errors.seek(0)
        if code != 0:
            log.warning("lse: jit:0 the second compile process failed (exit %d), compiling %s here: %s", code,
                        self.what, self.errors.read().decode(errors="replace")[-2000:])
        else:
            log.warning("lse: jit:0 compiled %s in the second process in %.1f s", self.what,
                        time.perf_counter() - self.began)
        self.errors.close()


def compile_beside(call: str, what: str) -> CompileBeside | None:
    """A CompileBeside, where this process may run on more than one core."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return CompileBeside(call, what) if cores > 1 else None


MADV_DONTNEED = 4


@functools.cache
def _llvm_file_mappings() -> tuple[tuple[int, int], ...]:
    """llvmlite's read-only mappings that hold no page of their own (smaps' Anonymous: 0; a relocated one,
    RELRO, does), as (start, end): the library's, loaded at import, so read once (smaps takes 0.3 s in a
    process of a thousand mappings)."""
    try:
        smaps = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return ()
    found, span = [], None   # span: the llvmlite read-only mapping whose fields are being read
    for line in smaps:
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            span = None
            if len(fields) >= 6 and "libllvmlite" in fields[5] and "w" not in fields[1]:
                span = tuple(int(a, 16) for a in fields[0].split("-"))
        elif span is not None and fields[0] == "Anonymous:" and fields[1] == "0":
            found.append(span)
    return tuple(found)


def release_compiler_pages() -> int:
    """Take LLVM's code out of the resident set; returns the bytes of mappings advised. llvmlite's shared
    library (about 70 MiB resident once the kernels are compiled or loaded from the cache, most of a small
    model's overhead over llama.cpp) runs to compile and to load compiled code, never to run it. Its
    mappings in ``_llvm_file_mappings`` are the file's pages, so MADV_DONTNEED unmaps them with nothing lost:
    they stay in the page cache, and a later compile maps them back (minor faults, ~15 ms here; MADV_PAGEOUT,
    which evicts them, made the next compile read them from disk, 0.25 s). Elsewhere (not Linux) it does
    nothing."""
    madvise = libc_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int)
    if madvise is None:
        return 0
    return sum(end - start for start, end in _llvm_file_mappings()
               if madvise(start, end - start, MADV_DONTNEED) == 0)
