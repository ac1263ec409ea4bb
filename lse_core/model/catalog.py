"""Which models a server holds and the id each is asked for by: `-m PATH` (repeated), every model in
`--models-dir DIR`, and `--alias ID=PATH`. An id comes from the file's or directory's name."""

from __future__ import annotations

import os
from dataclasses import dataclass

from lse_core.errors import StartupError

from .default import DEFAULT_FILE, default_model_path


@dataclass(frozen=True)
class ModelSpec:
    id: str
    path: str | None   # a .gguf file or a Hugging Face directory; None: the default model


def model_id(path: str | None) -> str:
    """The id of the model at ``path``: its name without .gguf (None: the default model's)."""
    name = os.path.basename(os.path.normpath(path)) if path is not None else DEFAULT_FILE
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name


def models_in(directory: str) -> list[str]:
    """Every .gguf file and Hugging Face directory (one holding config.json) in ``directory``, by name."""
    try:
        names = sorted(os.listdir(directory))
    except OSError as e:
        raise StartupError(f"--models-dir {directory}: {e.strerror}") from None
    paths = [os.path.join(directory, name) for name in names]
    return [p for p in paths if (os.path.isfile(p) and p.lower().endswith(".gguf"))
            or os.path.isfile(os.path.join(p, "config.json"))]


def model_specs(paths: list[str], models_dir: str | None = None, aliases: list[str] = ()) -> list[ModelSpec]:
    """The models to serve, in order: ``paths``, then those of ``models_dir``; an alias ``ID=PATH`` names the
    model at PATH (one listed already, or another). A model listed twice is served once; none: the default
    model. Raises StartupError
    for an alias without ``=`` or two models with one id."""
    in_dir = models_in(models_dir) if models_dir else []
    if models_dir and not in_dir:
        raise StartupError(f"--models-dir {models_dir} holds no .gguf file and no Hugging Face directory")
    listed = [*paths, *in_dir]
    found = [p for i, p in enumerate(listed) if os.path.realpath(p) not in map(os.path.realpath, listed[:i])]
    named: dict[str, str] = {}   # real path -> id given by an alias
    for alias in aliases:
        given, sep, path = alias.partition("=")
        if not sep or not given or not path:
            raise StartupError(f"--alias {alias!r} must be ID=PATH")
        named[os.path.realpath(path)] = given
        if os.path.realpath(path) not in map(os.path.realpath, found):
            found.append(path)
    specs = [ModelSpec(named.get(os.path.realpath(p), model_id(p)), p) for p in found] or [ModelSpec(model_id(None),
                                                                                                     None)]
    seen: dict[str, str | None] = {}
    for spec in specs:
        if spec.id in seen:
            raise StartupError(f"two models have the id {spec.id!r} ({seen[spec.id]} and {spec.path}); "
                               "name one with --alias ID=PATH")
        seen[spec.id] = spec.path
    return specs


def file_bytes(path: str | None) -> int:
    """The bytes of a model's weight files: what it is expected to take before it has been opened once."""
    if path is None:
        try:
            path = default_model_path()
        except StartupError:
            return 0
    if not os.path.isdir(path):
        return os.path.getsize(path) if os.path.isfile(path) else 0
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)
               if n.endswith((".safetensors", ".gguf", ".bin")))
