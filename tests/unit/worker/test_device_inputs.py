"""Step inputs staged onto the runner's device (worker/device_inputs.py), and the
device-generic runner: on CPU nothing moves; elsewhere every host tensor moves, numpy stays."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bladellm.attention.backend import AttentionMetadata
from bladellm.sample.draw import uniforms
from bladellm.sample.generators import step_generator
from bladellm.sample.metadata import SamplingMetadata
from bladellm.worker.device_inputs import DeviceStager, _host_bytes
from bladellm.worker.input_batch import StepInputs


def _step() -> StepInputs:
    meta = AttentionMetadata.single_prefill(5, 4)
    md = SamplingMetadata(temperature=torch.ones(1), all_greedy=False, all_random=True,
                          top_p=None, top_k=torch.tensor([3]), min_p=None,
                          generators={0: step_generator(1, 0)})
    return StepInputs(req_ids=["a"], input_ids=torch.arange(5), positions=torch.arange(5),
                      attn_metadata=meta, sample_indices=np.array([0]),
                      logits_indices=torch.tensor([4]), sampling=md,
                      token_lora_ids=np.zeros(5, np.int64))


def test_cpu_stage_is_the_identity():
    step = _step()
    assert DeviceStager(torch.device("cpu"), pin_memory=False).stage(step) is step


def test_every_host_tensor_moves_and_numpy_stays():
    step = _step()
    staged = DeviceStager(torch.device("meta"), pin_memory=False).stage(step)
    tensors = [staged.input_ids, staged.positions, staged.logits_indices,
               staged.attn_metadata.query_start_loc, staged.attn_metadata.seq_lens,
               staged.attn_metadata.block_tables, staged.attn_metadata.slot_mapping,
               staged.sampling.temperature, staged.sampling.top_k]
    assert all(t.device.type == "meta" for t in tensors)
    assert staged.sampling.top_p is None and staged.sampling.all_random
    assert staged.attn_metadata.query_start_loc_cpu is step.attn_metadata.query_start_loc_cpu
    assert staged.sample_indices is step.sample_indices
    assert staged.sampling.generators is step.sampling.generators  # host generators
    assert step.input_ids.device.type == "cpu"  # the host step is left as it was
    assert _host_bytes(step) == 64 * 9  # nine small host tensors, one cache line each


def test_seeded_uniforms_do_not_depend_on_the_batch():
    alone = uniforms(1, {0: step_generator(7, 3)}, torch.device("cpu"))
    torch.manual_seed(0)
    batched = uniforms(4, {2: step_generator(7, 3)}, torch.device("cpu"))
    assert batched[2] == alone[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_staging_on_cuda():
    dev = torch.device("cuda", 0)
    stager = DeviceStager(dev, pin_memory=True)
    step = _step()
    for _ in range(3):  # the arena is reused step after step
        staged = stager.stage(step)
        assert stager._arena.is_pinned()
        assert torch.equal(staged.input_ids.cpu(), step.input_ids)
        assert torch.equal(staged.attn_metadata.block_tables.cpu(),
                           step.attn_metadata.block_tables)
    alone = uniforms(1, {0: step_generator(7, 3)}, dev)
    batched = uniforms(4, {2: step_generator(7, 3)}, dev)
    assert batched[2].item() == alone[0].item() == uniforms(
        1, {0: step_generator(7, 3)}, torch.device("cpu"))[0].item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_llm_on_cuda_greedy_matches_cpu(tiny_llama):
    """The same runner on both devices: fp32 greedy tokens identical, seeded sampling of a
    request independent of its batch."""
    from bladellm import LLM
    from bladellm.sampling_params import SamplingParams

    prompts = ["hello world", "The quick brown fox", "1 2 3 4"]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(model=tiny_llama, dtype="float32", device=device, max_model_len=128,
                  # the reference kernels on the CPU side: nothing to compile on a GPU machine
                  **({"num_kv_blocks": 64, "kernels": "ref"} if device == "cpu" else {}))
        outs[device] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=8,
                                ignore_eos=True)
        alone = llm.generate(prompts[:1], seeded)[0].outputs[0].token_ids
        batch = llm.generate(prompts, [seeded, greedy, greedy])[0].outputs[0].token_ids
        assert alone == batch
        llm.shutdown()
    assert outs["cpu"] == outs["cuda"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("split", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_nccl_tp_and_pp_match_one_gpu(tiny_llama, split):
    """TP all-reduce / gather and PP send/recv over NCCL: greedy tokens as on one GPU."""
    from bladellm import LLM
    from bladellm.sampling_params import SamplingParams

    prompts = ["hello world", "The quick brown fox"]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = []
    for kw in ({}, split):
        llm = LLM(model=tiny_llama, dtype="float32", device="cuda", max_model_len=128, **kw)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, greedy)])
        llm.shutdown()
    assert outs[0] == outs[1]
