"""Hostile model files: a small valid GGUF and a tiny Hugging Face checkpoint's model.safetensors, truncated at
every offset of the header (and a sample of the data) and mutated (seeded random byte flips; every count,
length, type, dimension and offset overwritten with huge, negative-as-unsigned and zero values). Each load
must succeed (a mutation can be harmless) or raise a StartupError whose one-line message names the file:
never another exception, a crash, or an allocation the header alone asks for.

The loads run in a worker process (this file run as a script) under an address-space limit set after a
first, valid load, so a header that makes the loader allocate a gigabyte fails with MemoryError (reported as
a crash) and a segfault kills only the worker, whose last reported case says where it died.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HEADROOM = 1 << 30        # address space the worker may grow by past its valid load
FLIPS = 300               # random-flip cases per format
DATA_CUTS = 100           # truncations sampled after the header

U64_VALUES = (0, 1 << 40, 1 << 60, (1 << 64) - 1)   # (1 << 64) - 1 is -1 read as signed
U32_VALUES = (0, 1 << 31, (1 << 32) - 1)


def truncations(size: int, header_end: int, rng: random.Random) -> list[dict[str, Any]]:
    data_cuts = sorted(rng.sample(range(header_end, size), min(DATA_CUTS, size - header_end)))
    return [{"cut": n} for n in [*range(header_end), *data_cuts]]


def flips(header_end: int, rng: random.Random) -> list[dict[str, Any]]:
    """Cases of one to four random bytes of the header set to random values."""
    return [{"set": [(rng.randrange(header_end), rng.randrange(256)) for _ in range(rng.randint(1, 4))]}
            for _ in range(FLIPS)]


def gguf_cases(original: Path) -> list[dict[str, Any]]:
    """The cases for a GGUF file; gguf's own reader (not LSE's) says where the header's integers are."""
    import gguf

    reader = gguf.GGUFReader(str(original))
    fields = [*reader.fields.values(), *(t.field for t in reader.tensors)]
    targets = []   # (offset, width) of each count, length, type, dimension, offset and integer value
    for field in fields:
        position = field.offset
        for part in field.parts:
            if part.dtype.kind == "u" and part.dtype.itemsize in (4, 8) and len(part) <= 4:
                targets += [(position + i * part.dtype.itemsize, part.dtype.itemsize) for i in range(len(part))]
            position += part.nbytes
    overwrites = [{"set": list(enumerate(value.to_bytes(width, "little"), offset))}
                  for offset, width in targets for value in (U64_VALUES if width == 8 else U32_VALUES)]
    rng = random.Random(0)
    return truncations(original.stat().st_size, reader.data_offset, rng) + overwrites + flips(reader.data_offset, rng)


def safetensors_cases(original: Path) -> list[dict[str, Any]]:
    """The cases for a safetensors file: besides cuts and flips, the 8-byte header length overwritten, and
    each number in the JSON header replaced (the length then rewritten, so the entry checks are reached)."""
    data = original.read_bytes()
    header_bytes = int.from_bytes(data[:8], "little")
    header = data[8:8 + header_bytes]
    rng = random.Random(0)
    cases = truncations(len(data), 8 + header_bytes, rng)
    cases += [{"set": list(enumerate(value.to_bytes(8, "little")))}
              for value in (*U64_VALUES, header_bytes - 1, header_bytes + 1, len(data))]
    for number in re.finditer(rb"\d+", header):
        for value in (b"0", b"-1", b"18446744073709551615", b"1" + b"0" * 40):
            mutated = header[:number.start()] + value + header[number.end():]
            cases.append({"header": mutated.decode()})
    return cases + flips(8 + header_bytes, rng)


def run_worker(kind: str, original: Path, cases: list[dict[str, Any]], workdir: Path) -> list[dict[str, Any]]:
    """Every case's outcome from a worker process; fails the test if the worker itself dies or hangs."""
    cases_file = workdir / f"{kind}-cases.json"
    cases_file.write_text(json.dumps(cases))
    worker = subprocess.run([sys.executable, __file__, kind, str(original), str(cases_file), str(workdir)],
                            capture_output=True, text=True, timeout=600)
    outcomes = [json.loads(line) for line in worker.stdout.splitlines()]
    died_at = cases[len(outcomes)] if len(outcomes) < len(cases) else None
    assert worker.returncode == 0 and died_at is None, \
        f"worker exited {worker.returncode} at case {died_at}: {worker.stderr[-3000:]}"
    return outcomes


def assert_only_named_startup_errors(outcomes: list[dict[str, Any]], cases: list[dict[str, Any]]) -> None:
    bad = [(case, outcome) for case, outcome in zip(cases, outcomes) if outcome["result"] not in ("ok", "named")]
    assert not bad, f"{len(bad)} of {len(cases)} cases failed badly, e.g.: {bad[:3]}"
    assert outcomes[0]["result"] == "named"   # the empty file


def test_hostile_gguf_files_fail_with_the_file_named(tmp_path: Path):
    from test_gguf import write_small_gguf

    original = tmp_path / "small.gguf"
    write_small_gguf(original)
    cases = gguf_cases(original)
    assert_only_named_startup_errors(run_worker("gguf", original, cases, tmp_path), cases)


def test_hostile_safetensors_files_fail_with_the_file_named(llama_checkpoint: Path, tmp_path: Path):
    original = Path(shutil.copytree(llama_checkpoint, tmp_path / "original"))
    cases = safetensors_cases(original / "model.safetensors")
    assert_only_named_startup_errors(run_worker("safetensors", original, cases, tmp_path), cases)


def test_cli_prints_one_line_naming_a_truncated_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from test_gguf import write_small_gguf

    from lse_core.cli import main

    path = tmp_path / "truncated.gguf"
    write_small_gguf(path)
    path.write_bytes(path.read_bytes()[:3000])
    assert main(["-m", str(path), "-p", "hi"]) == 1
    printed = capsys.readouterr().err
    assert printed.count("\n") == 1 and printed.startswith(f"lse: {path}: ") and "truncated" in printed, printed


# ---- the worker: python test_hostile_files.py KIND ORIGINAL CASES_FILE WORKDIR ----

def mutate(data: bytes, case: dict[str, Any]) -> bytes:
    if "cut" in case:
        return data[:case["cut"]]
    if "header" in case:
        header = case["header"].encode()
        old_length = int.from_bytes(data[:8], "little")
        return len(header).to_bytes(8, "little") + header + data[8 + old_length:]
    mutated = bytearray(data)
    for offset, value in case["set"]:
        mutated[offset] = value
    return bytes(mutated)


def open_model(path: Path) -> None:
    """What lse_open does with a model before it touches a device."""
    from lse_core.model.arch import build_graph
    from lse_core.model.default import load_model
    from lse_core.template.render import ChatTemplate

    model = load_model(str(path))
    _ = model.tokenizer.max_token_bytes
    if model.chat_template is not None:
        ChatTemplate(model.chat_template, model.chat_template_source)
    build_graph(model)


def outcome(path: Path) -> dict[str, Any]:
    import traceback

    from lse_core.errors import StartupError

    try:
        open_model(path)
    except StartupError as e:
        message = str(e)
        named = str(path) in message and "\n" not in message
        return {"result": "named" if named else "unnamed", "message": message}
    except BaseException:   # MemoryError, RecursionError, numpy's errors...: each a failure of the loader
        return {"result": "crash", "message": traceback.format_exc()[-2000:]}
    return {"result": "ok"}


def worker(kind: str, original: Path, cases: list[dict[str, Any]], workdir: Path) -> None:
    import os
    import resource

    os.environ["LSE_CACHE_DIR"] = str(workdir / "cache")
    open_model(original)   # the valid file loads; and imports, thread pools and arenas are made before the limit
    with open("/proc/self/statm") as statm:
        virtual = int(statm.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (virtual + HEADROOM, virtual + HEADROOM))
    source = original / "model.safetensors" if kind == "safetensors" else original
    data = source.read_bytes()
    if kind == "safetensors":   # a copy of the checkpoint whose model.safetensors each case damages
        shutil.copytree(original, workdir / "damaged")
    for i, case in enumerate(cases):
        if kind == "safetensors":
            model = workdir / "damaged"
            (model / "model.safetensors").write_bytes(mutate(data, case))
        else:
            model = workdir / f"case{i}.gguf"
            model.write_bytes(mutate(data, case))
        print(json.dumps(outcome(model)), flush=True)
        if kind == "gguf":
            model.unlink()


if __name__ == "__main__":
    worker(sys.argv[1], Path(sys.argv[2]), json.loads(Path(sys.argv[3]).read_text()), Path(sys.argv[4]))
