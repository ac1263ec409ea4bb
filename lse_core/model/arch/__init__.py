"""One module per architecture, named after config.json's model_type; each has ``build(model) -> Graph``.
A new architecture is a new file here, found by name."""

from __future__ import annotations

import importlib
import pkgutil

from lse_core.errors import StartupError
from lse_core.graph.ir import Graph
from lse_core.model.model import Model


def supported() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def build_graph(model: Model) -> Graph:
    name = model.architecture
    if not name:
        raise StartupError(f"{model.source}: config.json has no model_type; LSE supports: {', '.join(supported())}")
    if not name.isidentifier() or name not in supported():
        raise StartupError(f"{model.source}: architecture {name!r} (config.json model_type) is not supported; "
                           f"LSE supports: {', '.join(supported())}")
    return importlib.import_module(f"{__name__}.{name}").build(model)
