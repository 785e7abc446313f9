"""CUDA graph steps end to end (worker/cuda_graphs.py).

Without a GPU, the runner's internal ``use_padded_eager_steps`` runs every graphable step
(decodes, sps verifications of one length) through the same code a graph replays on: the batch
padded to a captured size in the static buffers, padded requests on the null block, the output
sliced back. Greedy tokens must equal the plain engine's under the stress configuration (prompt
cache, chunked prefill, a KV pool small enough to preempt, block accounting checked every step),
with LoRA, an int8 KV cache and sps verification; a padded row that wrote into a real request's
KV, or an output row read from the padding, would change tokens.

The ``gpu`` tests capture real graphs and compare with ``--disable_cuda_graph``.
"""

from __future__ import annotations

import pytest
import torch

from bladellm import LLM, SamplingParams
from test_offline_llm import _prompts  # noqa: E402  (tests/e2e is on sys.path via rootdir)

MAX_TOKENS = 16
STRESS = dict(dtype="float32", block_size=4, max_num_batched_tokens=32, max_num_seqs=8,
              num_kv_blocks=44, max_model_len=160, debug_block_accounting=True)
SIZES = [1, 3, 5, 8]  # odd sizes: most batches are padded


def _generate(model_dir: str, prompts, padded: bool, lora_requests=None,
              max_tokens: int = MAX_TOKENS, **kwargs):
    llm = LLM(model=model_dir, **{**STRESS, **kwargs})
    runner = llm.engine.core.executor.worker.model_runner
    if padded:
        runner.use_padded_eager_steps(SIZES)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_requests)
    stats = llm.engine.core.scheduler.get_stats()
    assert stats.num_used_blocks == 0  # every block came back
    llm.engine.core.scheduler.check_invariants()
    graphs = runner.graphs
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], stats, graphs


def _check_padded_steps_ran(graphs, query_len: int = 1) -> None:
    assert graphs is not None and graphs.num_padded_reqs > 0
    assert sum(n for k, n in graphs.num_steps.items() if k.query_len == query_len) > 0


def test_padded_decode_steps_match_eager_under_stress(tiny_llama):
    prompts = _prompts(384)
    base, stats, _ = _generate(tiny_llama, prompts, padded=False)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0  # the stress paths ran
    padded, stats, graphs = _generate(tiny_llama, prompts, padded=True)
    assert stats.num_preemptions > 0
    _check_padded_steps_ran(graphs)
    assert padded == base


def test_padded_decode_steps_match_with_int8_kv(tiny_llama):
    prompts = _prompts(384)[:10]
    base, _, _ = _generate(tiny_llama, prompts, padded=False, kv_cache_quant="int8")
    padded, _, graphs = _generate(tiny_llama, prompts, padded=True, kv_cache_quant="int8")
    _check_padded_steps_ran(graphs)
    assert padded == base


def test_padded_decode_steps_match_with_lora(tiny_llama, tmp_path):
    from tiny_lora import make_adapter
    from bladellm.lora.request import LoRARequest

    adapter = make_adapter(tiny_llama, tmp_path / "qv", r=4, targets=["q_proj", "v_proj"],
                           seed=1, std=0.3)
    prompts = _prompts(384)[:8]
    lora = LoRARequest("qv", 1, adapter)
    requests = [lora if i % 2 else None for i in range(len(prompts))]  # mixed batches
    kwargs = dict(enable_lora=True, max_lora_rank=4, max_loras=1)
    base, _, _ = _generate(tiny_llama, prompts, padded=False, lora_requests=requests, **kwargs)
    padded, _, graphs = _generate(tiny_llama, prompts, padded=True, lora_requests=requests,
                                  **kwargs)
    _check_padded_steps_ran(graphs)
    assert padded == base
    plain, _, _ = _generate(tiny_llama, prompts, padded=False)
    assert [base[i] != plain[i] for i in (1, 3, 5, 7)].count(True) > 0  # the adapter acted


def test_padded_decode_steps_match_with_hybrid_kv_groups(tiny_model_factory):
    """Qwen2 with a global and a sliding-window layer: a KV cache group each, whose own block
    tables and slot mappings are padded too (and the window frees blocks under the tables)."""
    model_dir = tiny_model_factory("qwen2", use_sliding_window=True, sliding_window=8,
                                   max_window_layers=1)
    prompts = _prompts(384)[:10]
    base, _, _ = _generate(model_dir, prompts, padded=False, num_kv_blocks=56)
    padded, _, graphs = _generate(model_dir, prompts, padded=True, num_kv_blocks=56)
    assert graphs.buffers.groups  # the second group's buffers were used
    _check_padded_steps_ran(graphs)
    assert padded == base


def test_padded_sps_verification_steps_match(tiny_llama):
    prompts = _prompts(384)[:8]
    kwargs = dict(decode_algo="sps", draft_model=tiny_llama, gamma=3, spec_policy="always",
                  num_kv_blocks=64, max_num_batched_tokens=64, max_tokens=40)
    base, _, _ = _generate(tiny_llama, prompts, padded=False, **kwargs)
    padded, stats, graphs = _generate(tiny_llama, prompts, padded=True, **kwargs)
    assert stats.num_spec_draft_tokens > 0
    _check_padded_steps_ran(graphs, query_len=4)  # 1 + gamma tokens per request
    assert sum(n for k, n in graphs.num_steps.items() if k.query_len == 4) >= 10
    assert padded == base


def test_graph_size_flags_refused_on_a_cpu(tiny_llama):
    if torch.cuda.is_available():
        pytest.skip("--device auto resolves to the GPU here")
    with pytest.raises(ValueError, match="--cuda_graph_batch_sizes: CUDA graphs are captured "
                                         "on GPU devices only"):
        LLM(model=tiny_llama, device="auto", cuda_graph_batch_sizes=[1, 2], **STRESS)
    llm = LLM(model=tiny_llama, device="cpu", **STRESS)
    assert llm.engine.core.executor.worker.model_runner.graphs is None  # no graph on a CPU
    llm.shutdown()


def _cuda_llm(model_dir: str, **kwargs) -> LLM:
    return LLM(model=model_dir, device="cuda", dtype="float32", block_size=16,
               max_num_seqs=16, max_model_len=256, max_num_batched_tokens=256, **kwargs)


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager_greedy(tiny_llama):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    prompts = _prompts(384)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    eager = _cuda_llm(tiny_llama, disable_cuda_graph=True)
    assert eager.engine.core.executor.worker.model_runner.graphs is None
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    eager.shutdown()
    llm = _cuda_llm(tiny_llama, cuda_graph_batch_sizes=[1, 2, 4, 8, 16])
    graphs = llm.engine.core.executor.worker.model_runner.graphs
    assert len(graphs.graphs) == 5  # captured at start-up
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert sum(graphs.num_steps.values()) > 0 and graphs.num_padded_reqs > 0  # replayed
    # One request alone: batch-1 graph.
    one = llm.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()
    assert got == want
    assert one == want[0]
