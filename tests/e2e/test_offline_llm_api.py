"""Offline ``LLM`` API misuse fails clearly, before anything is queued: hand-built LoRARequests
are checked like ``LLM.lora_request``'s, sampling_params must be SamplingParams, and a shut-down
LLM refuses work."""

from __future__ import annotations

import pytest

from bladellm import LLM, SamplingParams
from bladellm.lora.registry import LoRANotFoundError
from bladellm.lora.request import LoRARequest
from tiny_lora import make_adapter

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def lora_llm(tiny_llama):
    return LLM(model=tiny_llama, dtype="float32", num_kv_blocks=64, enable_lora=True,
               max_lora_rank=8)


@pytest.fixture(scope="module")
def adapter(tiny_llama, tmp_path_factory):
    return make_adapter(tiny_llama, tmp_path_factory.mktemp("ad") / "a", r=4,
                        targets=["q_proj", "v_proj"], seed=0)


def _engine_empty(llm):
    assert not llm.engine.has_unfinished_requests()


def test_hand_built_lora_request_missing_path_raises(lora_llm, tmp_path):
    with pytest.raises((LoRANotFoundError, ValueError), match="nonexistent"):
        lora_llm.generate(["Hi", "Ho"], GREEDY, use_tqdm=False,
                          lora_request=LoRARequest("y", 99, str(tmp_path / "nonexistent")))
    _engine_empty(lora_llm)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken"):
        lora_llm.generate("Hi", GREEDY, use_tqdm=False,
                          lora_request=LoRARequest("b", 98, str(tmp_path / "broken")))
    _engine_empty(lora_llm)


def test_hand_built_lora_request_matches_registered(lora_llm, adapter, tiny_llama, tmp_path):
    prompt = [5, 17, 42, 9, 100]
    base = lora_llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    mine = LoRARequest("mine", 1000, adapter)
    out = lora_llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=mine)
    assert out[0].outputs[0].finish_reason == "length"
    registered = lora_llm.lora_request("reg", adapter)
    assert registered.lora_int_id != 1000
    ref = lora_llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=registered)
    assert out[0].outputs[0].token_ids == ref[0].outputs[0].token_ids != base
    # The same id for another adapter would share cached KV blocks with it: refused.
    other = make_adapter(tiny_llama, tmp_path / "other", r=4, targets=["k_proj"], seed=1)
    with pytest.raises(ValueError, match="lora_int_id"):
        lora_llm.generate([prompt], GREEDY, use_tqdm=False,
                          lora_request=LoRARequest("o", 1000, other))
    with pytest.raises(ValueError, match="lora_int_id"):
        lora_llm.generate([prompt], GREEDY, use_tqdm=False,
                          lora_request=LoRARequest("o", registered.lora_int_id, other))
    _engine_empty(lora_llm)
    with pytest.raises(TypeError, match="lora_request"):
        lora_llm.generate([prompt], GREEDY, use_tqdm=False, lora_request="reg")


def test_sampling_params_must_be_sampling_params(lora_llm):
    with pytest.raises(TypeError, match="sampling_params: must be a SamplingParams or a list"):
        lora_llm.generate("Hi", {"temperature": 0}, use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params"):
        lora_llm.generate(["Hi", "Ho"], [GREEDY, {"temperature": 0}], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params: got a list of 3 for 2 prompts"):
        lora_llm.generate(["Hi", "Ho"], [GREEDY] * 3, use_tqdm=False)
    _engine_empty(lora_llm)
    outs = lora_llm.generate(["Hi", "Ho"], [GREEDY, GREEDY.clone(max_tokens=2)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 2]


def test_generate_after_shutdown_raises(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=40)
    assert llm.generate("Hi", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()
    llm.shutdown()  # idempotent
    for call in (lambda: llm.generate("Hi", GREEDY, use_tqdm=False),
                 lambda: llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False),
                 lambda: llm.embed("Hi")):
        with pytest.raises(RuntimeError, match="shut down"):
            call()
