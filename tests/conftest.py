"""Session-wide tiny checkpoints (tests/checkpoints.py), written once per run by transformers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from checkpoints import write_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``tiny_checkpoint(arch, **options)``: the checkpoint write_checkpoint makes with those
    arguments, written on first use and shared by every test that asks for the same one (copy it
    before changing any of its files)."""
    written: dict[tuple, Path] = {}

    def get(arch: str, **options) -> Path:
        key = (arch, tuple(sorted((k, repr(v)) for k, v in options.items())))
        if key not in written:
            written[key] = write_checkpoint(tmp_path_factory.mktemp(arch), arch, **options)
        return written[key]

    return get


@pytest.fixture(scope="session")
def llama_checkpoint(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def qwen2_checkpoint(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("qwen2")


@pytest.fixture(scope="session")
def qwen3_checkpoint(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("qwen3")
