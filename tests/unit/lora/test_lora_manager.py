"""The adapter tiers: host memory (disk loads on a thread, LRU, wanted adapters never evicted)
and device slots (LRU, adapters of requests in the batch pinned)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from bladellm.attention import get_attn_backend
from bladellm.config import LoRAConfig, ModelConfig
from bladellm.kernels import resolve_kernels
from bladellm.kernels.scope import building_with
from bladellm.lora.manager import LoRAManager
from bladellm.lora.request import LoRARequest
from bladellm.checkpoint.hf_config import load_hf_config
from bladellm.model.loader import load_model


def write_adapter(path, seed: int) -> str:
    os.makedirs(path)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": 2, "lora_alpha": 2, "target_modules": ["q_proj"]},
                  f)
    gen = torch.Generator().manual_seed(seed)
    key = "base_model.model.model.layers.{}.self_attn.q_proj.lora_{}.weight"
    save_file({key.format(i, "A"): torch.randn(2, 64, generator=gen) for i in range(2)}
              | {key.format(i, "B"): torch.randn(64, 2, generator=gen) for i in range(2)},
              os.path.join(path, "adapter_model.safetensors"))
    return str(path)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("tier-adapters")
    return {i: LoRARequest(f"a{i}", i, write_adapter(root / f"a{i}", i)) for i in range(1, 5)}


def make_manager(tiny_llama, max_loras: int, max_cpu_loras: int) -> LoRAManager:
    cfg = load_hf_config(tiny_llama, trust_remote_code=False)
    kernels = resolve_kernels("auto", "cpu")  # what a CPU worker hands its model by default
    with building_with(kernels):
        model = load_model(ModelConfig(model=tiny_llama), cfg, torch.float32, "cpu",
                           get_attn_backend(None, kernels))
    config = LoRAConfig(enable_lora=True, max_loras=max_loras, max_cpu_loras=max_cpu_loras)
    return LoRAManager(config, model, cfg, torch.float32)


def sync_loaded(mgr: LoRAManager, wanted: list[LoRARequest]):
    """sync, let the started disk loads finish, sync again (collects them)."""
    mgr.sync(wanted)
    for fut in list(mgr.loading.values()):
        fut.result()
    return mgr.sync(wanted)


def test_host_tier_lru_never_evicts_wanted(tiny_llama, adapters):
    a = adapters
    mgr = make_manager(tiny_llama, max_loras=1, max_cpu_loras=2)
    ready, failed = mgr.sync([a[1]])
    assert ready == [] and 1 in mgr.loading  # the load runs off the caller's thread
    ready, _ = sync_loaded(mgr, [a[1], a[2]])
    assert sorted(ready) == [1, 2] and list(mgr.host) == [1, 2]
    sync_loaded(mgr, [a[1]])  # touch 1: 2 is now the least recently used
    assert list(mgr.host) == [2, 1]
    ready, _ = sync_loaded(mgr, [a[1], a[3]])  # 2 is not wanted: evicted for 3
    assert sorted(ready) == [1, 3] and set(mgr.host) == {1, 3}
    # Every host copy is wanted: 4's load waits instead of evicting one.
    ready, _ = sync_loaded(mgr, [a[1], a[3], a[4]])
    assert sorted(ready) == [1, 3] and 4 not in mgr.loading
    ready, _ = sync_loaded(mgr, [a[3], a[4]])  # 1's requests finished
    assert sorted(ready) == [3, 4] and set(mgr.host) == {3, 4}
    mgr.shutdown()


def test_failed_load_is_reported(tiny_llama, tmp_path):
    mgr = make_manager(tiny_llama, max_loras=1, max_cpu_loras=1)
    bad = LoRARequest("bad", 9, str(tmp_path))  # no adapter_config.json
    mgr.sync([bad])
    mgr.loading[9].exception()  # wait for the load to fail
    ready, failed = mgr.sync([bad])
    assert ready == [] and "adapter_config.json" in failed[9]
    mgr.shutdown()


def test_device_slots_lru_with_pinned_request(tiny_llama, adapters):
    a = adapters
    mgr = make_manager(tiny_llama, max_loras=2, max_cpu_loras=4)
    sync_loaded(mgr, list(a.values()))
    step = np.array([1, 1, 2, 0])
    mapping = mgr.prepare_step(step, pinned={1, 2})
    assert mapping is not None and list(mgr.slot_of) == [1, 2]
    mgr.prepare_step(np.array([2]), pinned={1, 2})  # 1 is now the least recently used...
    assert list(mgr.slot_of) == [1, 2]
    mgr.prepare_step(np.array([3]), pinned={1, 3})  # ...but pinned by a running request
    assert set(mgr.slot_of) == {1, 3}  # so 2 was evicted
    mgr.prepare_step(np.array([4]), pinned={4})  # nothing pinned: plain LRU evicts 1
    assert set(mgr.slot_of) == {3, 4}
    with pytest.raises(RuntimeError, match="--max_loras"):
        mgr.prepare_step(np.array([1]), pinned={1, 3, 4})
    assert mgr.prepare_step(np.array([0, 0]), pinned=set()) is None  # base model only
    mgr.shutdown()


def test_slot_holds_the_adapter_delta(tiny_llama, adapters):
    mgr = make_manager(tiny_llama, max_loras=2, max_cpu_loras=2)
    sync_loaded(mgr, [adapters[1]])
    mgr.prepare_step(np.array([1]), pinned={1})
    layer = mgr.layers[(0, "qkv_proj")]
    a, b = mgr.host[1].modules[(0, "q_proj")]
    slot = mgr.slot_of[1]
    x = torch.randn(3, 64)
    delta = x @ layer.lora_a[slot] @ layer.lora_b[slot]  # [3, q + k + v]
    q = layer.sizes[0]
    torch.testing.assert_close(delta[:, :q], x @ a.t() @ b.t())
    assert not delta[:, q:].any()  # k, v untargeted
    mgr.shutdown()
