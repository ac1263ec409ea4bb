"""numba's disk cache for the jit device, keyed by all of the device's sources.

numba keys a function's cached machine code by its own file only (a hash of it, or its time stamp in
older releases), but compiles every @njit function it calls into the caller's code: ``execute`` in
program.py holds the kernels of the other files (quant.py, attention.py...), and a generated elementwise
function holds kernels.expf. Edit one of those files and the callers' cached code would go on running the
old kernels, on data laid out the new way. So every function cached from this package's directory, or from
the directory of generated sources, is stamped with its own file and every source file of this package.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

from numba.core import caching
from numba.core.caching import _CacheLocator

_CacheImpl = getattr(caching, "CacheImpl", None) or caching._CacheImpl  # renamed in numba 0.6x

PACKAGE = Path(__file__).resolve().parent


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
    which), stamped with that file's own stamp and the package's."""

    def __init__(self, inner: _CacheLocator) -> None:
        self.inner = inner

    def ensure_cache_path(self) -> None:
        self.inner.ensure_cache_path()

    def get_cache_path(self) -> str:
        return self.inner.get_cache_path()

    def get_source_stamp(self) -> tuple:
        return self.inner.get_source_stamp(), package_stamp()

    def get_disambiguator(self) -> str:
        return self.inner.get_disambiguator()

    @classmethod
    def from_function(cls, py_func: Callable, py_file: str) -> PackageLocator | None:
        if Path(py_file).resolve().parent not in (PACKAGE, generated_sources().resolve()):
            return None
        for other in _CacheImpl._locator_classes:
            if other is not cls and (inner := other.from_function(py_func, py_file)) is not None:
                return cls(inner)
        return None


def install() -> None:
    """Have numba locate this package's caches (and generated sources') through PackageLocator."""
    if PackageLocator not in _CacheImpl._locator_classes:
        _CacheImpl._locator_classes.insert(0, PackageLocator)
