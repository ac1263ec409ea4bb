"""The example third-party backend, plugins/lse-hrx, installed as a user would (pip install
./plugins/lse-hrx; .ci/run does it): found through its entry point, declining on HRX_DEVICES=0,
compiling the groups its kernel set covers, refusing the rest with "no kernel for <op>", and computing
what the CPU interpreter computes."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import numpy as np
import pytest
from checkpoints import cpu_plan, make_step, prompt_ids

from lse_backends.cpu import CPUDevice
from lse_core.devices.hookspec import CompileContext
from lse_core.devices.registry import discover, resolve_pool
from lse_core.errors import StartupError
from lse_core.graph import ir
from lse_core.graph.fuse import FusedGroup, fuse
from lse_core.graph.plan import Plan
from lse_core.model.arch import build_graph
from lse_core.model.files import load_hf

CTX = CompileContext(kv_slots=4, kv_len=64, max_tokens=32)
# What the plugin leaves out on purpose (its README); everything else in the IR it runs.
NOT_ON_HRX = {"silu", "gelu", "scale", "penalize", "temperature", "top_k", "top_p", "min_p"}


@pytest.fixture(scope="module", autouse=True)
def installed() -> None:
    names = [ep.name for ep in importlib.metadata.entry_points(group="lse.backends")]
    if "hrx" not in names:
        pytest.fail("the lse-hrx plugin is not installed in this environment: pip install ./plugins/lse-hrx "
                    f"(lse.backends entry points found: {names})", pytrace=False)


@pytest.fixture
def hrx(monkeypatch):
    monkeypatch.setenv("HRX_DEVICES", "1")
    monkeypatch.delenv("HRX_MISSING", raising=False)
    device = discover().backends["hrx"].open(0)
    yield device
    device.close()


def test_found_through_its_entry_point_and_up(monkeypatch):
    monkeypatch.setenv("HRX_DEVICES", "1")
    (ep,) = [ep for ep in importlib.metadata.entry_points(group="lse.backends") if ep.name == "hrx"]
    assert ep.value == "lse_hrx" and ep.dist.name == "lse-hrx"
    registry = discover()
    assert "hrx" in registry.backends and "hrx" not in registry.failures
    (info,) = registry.devices("hrx")
    assert (info.name, info.kind, info.codegen, info.declined) == ("hrx:0", "accelerator", True, None)
    infos, warnings = resolve_pool(registry, "hrx:0", refuse_cpu=True)
    assert [d.name for d in infos] == ["hrx:0"] and warnings == []


def test_imports_only_lses_contract():
    code = "import sys, lse_hrx; print(sorted(m for m in sys.modules if m.startswith('lse_backends')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("setting", ["0", None])
def test_without_hrx_devices_it_declines_and_the_pool_does_not_come_up(monkeypatch, setting):
    if setting is None:
        monkeypatch.delenv("HRX_DEVICES", raising=False)    # a simulator: no devices unless asked
    else:
        monkeypatch.setenv("HRX_DEVICES", setting)
    registry = discover()
    (info,) = registry.devices("hrx")
    assert info.declined.startswith("no hrx device found")
    assert any(line.startswith("hrx: no hrx device found") for line in registry.declined())
    for refuse_cpu in (False, True):
        with pytest.raises(StartupError, match="device hrx:0 did not come up: no hrx device found"):
            resolve_pool(registry, "hrx:0", refuse_cpu)


def test_compiles_its_kernels_and_names_the_first_missing_one(llama_checkpoint, hrx):
    graph = build_graph(load_hf(str(llama_checkpoint)))
    answers = {g.describe(): hrx.compile(g, {p: graph.weights[p] for p in g.params}, CTX) for g in fuse(graph)}
    refused = {group: answer for group, answer in answers.items() if isinstance(answer, str)}
    for group in fuse(graph):
        missing = [op for op in group.ops if op in NOT_ON_HRX]
        if missing:
            assert refused[group.describe()] == f"no kernel for {missing[0]}"
        else:
            assert callable(answers[group.describe()]), group.describe()
    assert sorted(set(refused.values())) == [f"no kernel for {op}" for op in
                                             ("min_p", "penalize", "silu", "temperature", "top_k", "top_p")]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_runs_a_model_with_the_interpreter_taking_what_it_lacks(tiny_checkpoint, arch, hrx):
    model = load_hf(str(tiny_checkpoint(arch)))
    causes: list[str] = []
    plan = Plan.build(build_graph(model), [hrx], CTX, fallback_device=CPUDevice(), on_fallback=causes.append)
    reference = cpu_plan(model, CTX.kv_slots, CTX.kv_len, CTX.max_tokens)
    assert {p.device.info.name for p in plan.placements} == {"hrx:0", "cpu:0"}
    prompt = prompt_ids(tiny_checkpoint(arch))
    steps = [make_step([(1, prompt[:5], 0)]), make_step([(1, prompt[5:], 5), (3, prompt, 0)])]
    for step in steps:
        got, want = plan.run(step, want_logits=True), reference.run(step, want_logits=True)
        np.testing.assert_allclose(got.logits, want.logits, rtol=1e-4, atol=1e-4)
        assert got.next_tokens.tolist() == want.next_tokens.tolist()
    # greedy decoding needs no logits processor: only the silu groups fell back, once per layer per step
    assert set(causes) == {f"{g.describe()}; hrx:0: no kernel for silu" for g in fuse(build_graph(model))
                           if "silu" in g.ops}


def node_group(node: ir.Node) -> FusedGroup:
    return FusedGroup(0, (node,), node.inputs, (node.output,), node.params)


def test_windowed_attention_and_sampling_match_the_interpreter(hrx):
    rng = np.random.default_rng(1)
    attention = ir.Node("attention", ("q", "k", "v"), "o", (), {"n_heads": 4, "n_kv_heads": 2, "head_dim": 16,
                                                              "scale": 0.25, "window": 3})
    steps = [make_step([(0, list(range(6)), 0)]), make_step([(0, [1], 6), (2, [1, 2], 0)])]
    inputs = [[rng.standard_normal((s.n_tokens, w)).astype(np.float32) for w in (64, 32, 32)] for s in steps]
    sample = ir.Node("sample", ("logits",), "next_tokens")
    logits = rng.standard_normal((3, 500)).astype(np.float32) * 3
    sampling_step = make_step([(i, [0], 0) for i in range(3)])
    sampling_step.sampling.temperature = np.array([0.0, 0.9, 1.0], np.float32)
    sampling_step.sampling.uniform = np.array([0.5, 0.25, 0.999], np.float32)
    sampling_step.sampling.constrained = np.array([True, True, False])     # structured output's mask
    sampling_step.sampling.token_mask = rng.integers(-2**31, 2**31, (3, 16), dtype=np.int64).astype(np.int32)
    mask = ir.Node("mask", ("logits",), "masked")
    results = []
    for device in (hrx, CPUDevice()):
        attend = device.compile(node_group(attention), {}, CTX)
        outs = [device.to_host(attend([device.to_device(x) for x in xs], s)[0]) for s, xs in zip(steps, inputs)]
        draw = device.compile(node_group(sample), {}, CTX)
        masked = device.compile(node_group(mask), {}, CTX)([device.to_device(logits)], sampling_step)
        tokens = device.to_host(draw(masked, sampling_step)[0])
        results.append((outs, tokens, device.to_host(masked[0])))
    (got, got_tokens, got_masked), (want, want_tokens, want_masked) = results
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got_masked, want_masked)
    assert got_tokens.tolist() == want_tokens.tolist()
    assert got_tokens[0] == np.argmax(want_masked[0])
