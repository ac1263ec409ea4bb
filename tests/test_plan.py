"""Placement across a pool of several devices: layers split in pool order, explicit copies between
devices, and the result equals one device's."""

from __future__ import annotations

from checkpoints import lse_greedy, prompt_ids

from lse_core.api import EVENT_END, lse_close, lse_open_or_raise, lse_request_iter
from lse_core.config import LSEConfig
from lse_core.model.files import load_hf


def test_two_devices_split_the_layers_in_order_and_agree_with_one(tiny_checkpoint):
    path = tiny_checkpoint("llama", num_hidden_layers=4)
    lse = lse_open_or_raise(LSEConfig(model=str(path), pool="opencl:0,jit:0", kv_len=64, parallel=1))
    try:
        by_layer: dict[int, set[str]] = {}
        for p in lse.plan.placements:
            by_layer.setdefault(p.group.layer, set()).add(p.device.info.name)
            assert p.fallback_cause is None
        assert [by_layer[i] for i in range(4)] == [{"opencl:0"}, {"opencl:0"}, {"jit:0"}, {"jit:0"}]
        prompt = prompt_ids(path)
        events = list(lse_request_iter(lse, {"prompt": prompt, "max_tokens": 8, "temperature": 0}, "completion"))
        assert events[-1].kind == EVENT_END
        text = events[-1].data["choices"][0]["text"]
    finally:
        lse_close(lse)
    ids, _ = lse_greedy(load_hf(str(path)), prompt, 8)
    assert text == load_hf(str(path)).tokenizer.decode(ids, skip_special_tokens=True)
