"""Placement across a pool of several devices: layers split in pool order, explicit copies between
devices, and the result equals one device's."""

from __future__ import annotations

from checkpoints import lse_greedy, prompt_ids

from lse_core.api import EVENT_END, lse_close, lse_open_or_raise, lse_request_iter
from lse_core.config import LSEConfig
from lse_core.model.files import load_hf


def test_a_fallback_group_splits_the_linked_run_around_it(tiny_checkpoint, monkeypatch):
    """A group the pool device cannot run goes to the CPU interpreter as its own stage; jit:0 links the
    runs before and after it, and the answer is still the interpreter's."""
    path = tiny_checkpoint("llama", num_hidden_layers=2)
    from lse_backends.jit import JitDevice

    compile_group = JitDevice.compile

    def no_silu(self, group, weights, ctx):
        return "no kernel for silu" if "silu" in group.ops else compile_group(self, group, weights, ctx)

    monkeypatch.setattr(JitDevice, "compile", no_silu)
    lse = lse_open_or_raise(LSEConfig(model=str(path), pool="jit:0", kv_len=64, parallel=1))
    try:
        model_stages = [s for s in lse.plan.stages if s.placements[0].group.sampling_op is None]
        kinds = [("cpu" if s.device.info.name == "cpu:0" else f"jit x{len(s.placements)}") for s in model_stages]
        assert kinds[1::2] == ["cpu", "cpu"] and all(k.startswith("jit x") for k in kinds[0::2]), kinds
        assert len(kinds) == 5 and all(int(k[5:]) > 1 for k in kinds[0::2])
        prompt = prompt_ids(path)
        events = list(lse_request_iter(lse, {"prompt": prompt, "max_tokens": 6, "temperature": 0}, "completion"))
        text = events[-1].data["choices"][0]["text"]
    finally:
        lse_close(lse)
    ids, _ = lse_greedy(load_hf(str(path)), prompt, 6)
    assert text == load_hf(str(path)).tokenizer.decode(ids, skip_special_tokens=True)


def test_two_devices_split_the_layers_in_order_and_agree_with_one(tiny_checkpoint):
    path = tiny_checkpoint("llama", num_hidden_layers=4)
    lse = lse_open_or_raise(LSEConfig(model=str(path), pool="opencl:0,jit:0", kv_len=64, parallel=1))
    try:
        by_layer: dict[int, set[str]] = {}
        for p in lse.plan.placements:
            by_layer.setdefault(p.group.layer, set()).add(p.device.info.name)
            assert p.fallback_cause is None
        assert [by_layer[i] for i in range(4)] == [{"opencl:0"}, {"opencl:0"}, {"jit:0"}, {"jit:0"}]
        # jit:0 links its run of groups (layers 2, 3, the final norm and the output projection) into one
        # stage, which reads the hidden state copied from opencl:0; opencl:0 runs a stage per group
        def model_groups(placements):
            return [p for p in placements if p.group.sampling_op is None]

        (linked,) = [s for s in lse.plan.stages if s.device.info.name == "jit:0" and model_groups(s.placements)]
        assert linked.placements == [p for p in model_groups(lse.plan.placements) if p.device is linked.device]
        assert {p.group.layer for p in linked.placements} == {2, 3, -1}
        # the final norm's rows stay readable: embeddings pool them
        assert len(linked.inputs) >= 1 and linked.outputs == ("final_norm", "logits")
        assert all(len(s.placements) == 1 for s in lse.plan.stages if s.device.info.name == "opencl:0")
        prompt = prompt_ids(path)
        events = list(lse_request_iter(lse, {"prompt": prompt, "max_tokens": 8, "temperature": 0}, "completion"))
        assert events[-1].kind == EVENT_END
        text = events[-1].data["choices"][0]["text"]
    finally:
        lse_close(lse)
    ids, _ = lse_greedy(load_hf(str(path)), prompt, 8)
    assert text == load_hf(str(path)).tokenizer.decode(ids, skip_special_tokens=True)
