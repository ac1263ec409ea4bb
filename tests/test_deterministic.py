"""--deterministic (issue 23): a request's greedy tokens and its logits, bit for bit, do not depend on
whether its prompt's prefix came from the KV cache, on the sequences it was batched with, or on how its
prompt was split into prefill chunks; on jit:0 and on the CPU interpreter. Without the mode they do (the
kernels pick their paths by the step's row count), which the last plan test shows, so these can fail.

The model is test_gguf's small GGUF: Q4_0, Q4_1 and Q8_0 linears (every quantized path of jit:0) besides
float ones."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from checkpoints import greedy_sampling, make_step
from test_gguf import write_small_gguf
from test_quant_kernels import gguf_weight, prepared

import lse_backends.jit.quant as quant
from lse_backends.cpu import CPUDevice
from lse_backends.jit import JitDevice
from lse_core.api import LSE, lse_close, lse_open_or_raise, lse_request, lse_request_iter
from lse_core.cli import add_engine_options, config_from_args
from lse_core.devices.hookspec import CompileContext
from lse_core.errors import StartupError
from lse_core.graph.plan import Plan
from lse_core.model.arch import build_graph
from lse_core.model.gguf import load_gguf

DEVICES = {"jit:0": JitDevice, "cpu:0": CPUDevice}
PROMPT = [int(t) for t in np.random.default_rng(1).integers(3, 250, 40)]   # past the decode steps' 16 rows
N_NEW = 6


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("deterministic") / "small.gguf"
    write_small_gguf(path, "llama")
    return path


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LSE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "lse-cache"))


@dataclass
class Seq:
    """A sequence the test schedules itself: ``chunk`` prompt rows a step from step ``start`` on."""

    slot: int
    tokens: list[int]
    n_new: int
    chunk: int
    start: int = 0
    computed: int = 0
    logits: list[np.ndarray] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokens = list(self.tokens)
        self.end = len(self.tokens) + self.n_new

    @property
    def reply(self) -> list[int]:
        return self.tokens[self.end - self.n_new:]


def run(plan: Plan, seqs: list[Seq]) -> None:
    """Steps as the engine makes them: every joined, unfinished sequence takes its next chunk (one row
    once decoding); each sampled row's logits are kept and its greedy token appended."""
    step = 0
    while any(len(s.tokens) < s.end for s in seqs):
        batch = [(s, min(s.chunk, len(s.tokens) - s.computed)) for s in seqs
                 if s.start <= step and len(s.tokens) < s.end]
        out = plan.run(make_step([(s.slot, s.tokens[s.computed:s.computed + n], s.computed) for s, n in batch],
                                 greedy_sampling(len(batch))), want_logits=True)
        for i, (s, n) in enumerate(batch):
            s.computed += n
            if s.computed == len(s.tokens):
                s.logits.append(out.logits[i].copy())
                s.tokens.append(int(out.next_tokens[i]))
        step += 1


def target(chunk: int = len(PROMPT)) -> Seq:
    return Seq(0, PROMPT, N_NEW, chunk)


def alone(plan: Plan, chunk: int = len(PROMPT)) -> Seq:
    seq = target(chunk)
    run(plan, [seq])
    return seq


def cached(plan: Plan) -> Seq:
    """The prompt after a request that shared all of it but its last token: only that token is computed."""
    run(plan, [Seq(0, PROMPT[:-1] + [7, 8, 9], 2, len(PROMPT) + 2)])
    seq = Seq(0, PROMPT, N_NEW, 1, computed=len(PROMPT) - 1)
    run(plan, [seq])
    return seq


# other sequences in the target's steps: prefilling in chunks of their own, decoding, joining late
OTHERS = [Seq(1, PROMPT[5:30], 8, 25), Seq(2, [11, 12, 13, 14, 15, 16, 17, 18, 19], 9, 9, start=2),
          Seq(3, list(range(20, 80)), 4, 13, start=1)]


def batched(plan: Plan, n_others: int) -> Seq:
    seq = target()
    run(plan, [seq] + [Seq(o.slot, o.tokens, o.n_new, o.chunk, o.start) for o in OTHERS[:n_others]])
    return seq


def same_bits(a: Seq, b: Seq) -> bool:
    return a.reply == b.reply and np.array_equal(np.stack(a.logits).view(np.uint32), np.stack(b.logits).view(np.uint32))


@pytest.fixture(scope="module", params=list(DEVICES))
def device_name(request) -> str:
    return request.param


def plan(device_name: str, small_gguf: Path, deterministic: bool) -> Plan:
    ctx = CompileContext(kv_slots=4, kv_len=128, max_tokens=64, deterministic=deterministic)
    return Plan.build(build_graph(load_gguf(str(small_gguf))), [DEVICES[device_name]()], ctx)


@pytest.fixture(scope="module")
def deterministic_plan(device_name: str, small_gguf: Path) -> Plan:
    return plan(device_name, small_gguf, True)


@pytest.fixture(scope="module")
def reference(deterministic_plan: Plan) -> Seq:
    return alone(deterministic_plan)


def test_a_cached_prefix_gives_the_same_bits(deterministic_plan: Plan, reference: Seq) -> None:
    assert same_bits(cached(deterministic_plan), reference)


@pytest.mark.parametrize("n_others", [1, 2, 3])
def test_batching_gives_the_same_bits(deterministic_plan: Plan, reference: Seq, n_others: int) -> None:
    assert same_bits(batched(deterministic_plan, n_others), reference)


@pytest.mark.parametrize("chunk", [1, 3, 16, 17])
def test_prefill_chunks_give_the_same_bits(deterministic_plan: Plan, reference: Seq, chunk: int) -> None:
    assert same_bits(alone(deterministic_plan, chunk), reference)


def test_the_deterministic_logits_are_the_models(deterministic_plan: Plan, reference: Seq, device_name: str,
                                                 small_gguf: Path) -> None:
    """The row-at-a-time paths compute the same model as the default ones, to float32 (and int8) rounding. On
    jit:0 the two take int8 activations in different linears (a deterministic prefill in the Q4 ones, a
    default one in the Q8_0 and Q5_0 ones), so their logits differ by both roundings (2.1% of the
    largest logit measured)."""
    default = alone(plan(device_name, small_gguf, False))
    logits, expected = np.stack(reference.logits), np.stack(default.logits)
    np.testing.assert_allclose(logits, expected, atol=0.04 * np.abs(expected).max())


def test_without_the_mode_the_bits_differ(device_name: str, small_gguf: Path) -> None:
    """What these tests catch: by default, caching or batching changes the kernel path of a row, and its bits."""
    default = plan(device_name, small_gguf, False)
    reference = alone(default)
    outcomes = [same_bits(cached(default), reference), same_bits(batched(default, 3), reference),
                same_bits(alone(default, 3), reference)]
    assert not all(outcomes), "no case changed a bit: the tests above would pass without --deterministic"


@pytest.mark.parametrize("qtype, rows, n, wide", [
    ("Q4_0", 37, 320, quant.WIDE_PREFILL), ("Q4_1", 600, 256, quant.WIDE_PREFILL), ("Q8_0", 37, 320, 0),
    ("Q4_K", 37, 768, quant.WIDE_PREFILL), ("Q6_K", 200, 256, 0), ("Q5_K", 37, 768, 0),
    ("Q4_0", 37, 320, quant.WIDE_PREFILL | quant.WIDE_DECODE), ("Q4_K", 37, 768, quant.WIDE_DECODE)])
def test_each_row_of_a_quantized_linear_is_its_one_row_product(qtype: str, rows: int, n: int, wide: int) -> None:
    """Every weight type jit:0 reads in place, rows in groups and the rows % 8 kept as stored, at step sizes
    that reach every tile and panel by default, and Q4 ones with activations of one plane or two at every
    step (quant._planes): row_invariant gives each row the bits of a one-row step."""
    blocks, _ = gguf_weight(qtype, rows, n)
    kind, laid_out = prepared(qtype, blocks)
    x = np.random.default_rng(2).standard_normal((40, n)).astype(np.float32)
    alone = np.empty((40, rows), np.float32)
    for t in range(40):
        quant.linear(kind, laid_out, x[t:t + 1], alone[t:t + 1], False, wide)
    for tokens in (2, 3, 8, 16, 17, 40):
        out = np.empty((tokens, rows), np.float32)
        quant.linear(kind, laid_out, x[:tokens], out, True, wide)
        np.testing.assert_array_equal(out.view(np.uint32), alone[:tokens].view(np.uint32), err_msg=f"{tokens} rows")


# ---- through lse_open: the option, the engine, seeded sampling, the refusal ----

@pytest.fixture(scope="module")
def lse(small_gguf: Path) -> Iterator[LSE]:
    engine = lse_open_or_raise({"model": str(small_gguf), "pool": "jit:0", "kv_len": 128, "parallel": 4,
                                "prefill_chunk": 16, "deterministic": True})
    yield engine
    lse_close(engine)


def complete(lse: LSE, prompt: list[int], **fields) -> dict:
    events = list(lse_request_iter(lse, {"prompt": prompt, "max_tokens": N_NEW, "temperature": 0, "logprobs": 3,
                                         "ignore_eos": True} | fields, "completion"))
    assert events[-1].kind == "end", events[-1].data
    return events[-1].data


def reply(data: dict) -> tuple:
    choice = data["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"], choice["logprobs"]["top_logprobs"]


def test_the_option_reaches_the_kernels(lse: LSE) -> None:
    assert lse.config.deterministic and lse.plan.ctx.deterministic
    args = argparse.ArgumentParser()
    add_engine_options(args)
    assert config_from_args(args.parse_args(["--deterministic"])).deterministic
    assert not config_from_args(args.parse_args([])).deterministic


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 5}], ids=["greedy", "seeded"])
def test_the_engine_replies_alike_cached_and_batched(lse: LSE, sampling: dict) -> None:
    """The first request computes the whole prompt; the repeat finds all of it but the last token in a
    slot; the third is queued behind three others, which prefill and decode in its steps (its logprobs,
    from the logits, equal too)."""
    first = complete(lse, PROMPT, **sampling)
    repeat = complete(lse, PROMPT, **sampling)
    assert repeat["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT) - 1
    others = [lse_request(lse, {"prompt": o.tokens, "max_tokens": o.n_new, "ignore_eos": True}, lambda event: None,
                          "completion") for o in OTHERS]
    crowded = complete(lse, PROMPT, **sampling)
    for other in others:
        assert other.done.wait(60)
    assert reply(first) == reply(repeat) == reply(crowded)


@pytest.mark.parametrize("pool", ["opencl:0", "hrx:0", "jit:0,opencl:0"])
def test_a_device_that_cannot_is_refused_at_startup(small_gguf: Path, monkeypatch: pytest.MonkeyPatch,
                                                    pool: str) -> None:
    """OpenCL's and the hrx plugin's devices do not declare the mode: the startup error names them."""
    monkeypatch.setenv("HRX_DEVICES", "1")
    monkeypatch.setenv("HRX_MISSING", "")
    device = pool.split(",")[-1]
    with pytest.raises(StartupError, match=rf"--deterministic is not supported by {device}: "):
        lse_open_or_raise({"model": str(small_gguf), "pool": pool, "kv_len": 64, "deterministic": True})
