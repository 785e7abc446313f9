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
from bladellm.worker import device_inputs
from bladellm.worker.device_inputs import DeviceStager, _host_tensors
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
    assert len(_host_tensors(step)) == 9


def _hybrid_mrope_step() -> StepInputs:
    """A step with what the flat walk missed: hybrid KV groups' (tables, slots) pairs in a
    list, and M-RoPE's [3, T] positions (a strided view here)."""
    step = _step()
    step.positions = torch.arange(30).view(5, 6).t()[:3, :5]  # [3, 5], not contiguous
    step.group_tables = [(torch.arange(40, dtype=torch.int32).view(1, 40) + 100 * g,
                          torch.arange(5, dtype=torch.int64) + 1000 * g) for g in (1, 2)]
    return step


def _arena_holds(arena: torch.Tensor, host: list[torch.Tensor]) -> bool:
    used = 0
    for t in host:
        nbytes = t.numel() * t.element_size()
        if not torch.equal(arena[used:used + nbytes].view(t.dtype).view(t.shape), t):
            return False
        used += -(-nbytes // 64) * 64
    return True


class _LoggingFence(device_inputs.CopyFence):
    def __init__(self, stager_ref: list) -> None:
        self.log: list[str] = []
        self.stager_ref = stager_ref
        self.expected: list[torch.Tensor] = []

    def wait(self) -> None:
        self.log.append("wait")

    def record(self) -> None:
        # Recorded after the step's last copy: the arena already holds every tensor.
        assert _arena_holds(self.stager_ref[0]._arena, self.expected)
        self.log.append("record")


def test_pinned_arena_holds_nested_group_tables_and_mrope_positions(monkeypatch):
    """The arena path on a CPU (pinned memory swapped for plain): every host tensor, nested
    ones included, gets a slot of the arena sized for all of them, and moves."""
    monkeypatch.setattr(device_inputs, "_pinned_bytes",
                        lambda n: torch.empty(n, dtype=torch.uint8))
    step = _hybrid_mrope_step()
    host = _host_tensors(step)
    assert any(t is step.group_tables[1][0] for t in host)  # nested: counted and copied
    assert len(host) == 13
    ref: list = []
    fence = _LoggingFence(ref)
    stager = DeviceStager(torch.device("meta"), pin_memory=True, fence=fence)
    ref.append(stager)
    fence.expected = host
    staged = stager.stage(step)
    assert staged.positions.shape == (3, 5) and staged.positions.device.type == "meta"
    assert all(t.device.type == "meta" for pair in staged.group_tables for t in pair)
    assert isinstance(staged.group_tables[0], tuple)
    assert _arena_holds(stager._arena, host)
    assert step.group_tables[0][0].device.type == "cpu"  # the host step is left as it was
    small = _step()  # a smaller next step reuses the arena, after waiting on the fence
    fence.expected = _host_tensors(small)
    arena = stager._arena
    stager.stage(small)
    assert stager._arena is arena
    assert fence.log == ["wait", "record", "wait", "record"]


def test_runner_platforms_hand_the_stager_a_fence():
    from bladellm.platforms.cpu_platform import CpuPlatform
    from bladellm.platforms.cuda import CudaCopyFence, CudaPlatform

    fence = CpuPlatform().copy_fence(torch.device("cpu"))
    fence.wait(), fence.record(), fence.wait()  # no-ops on a CPU
    assert isinstance(CudaPlatform().copy_fence(torch.device("cuda", 0)), CudaCopyFence)
    CudaCopyFence(torch.device("cuda", 0)).wait()  # nothing recorded yet: returns


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
    """The same runner on both devices: fp32 greedy tokens identical. A seeded request's
    uniforms do not depend on its batch; its tokens do not either on a CPU, and on a GPU only up
    to floating-point rounding (the batch's shape changes the kernels' tiling, so a uniform
    within rounding of a CDF boundary may pick the neighbour, docs/gpu.md): there the first
    sampled token, drawn from a prefill, must agree."""
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
        assert alone == batch if device == "cpu" else alone[:1] == batch[:1]
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
