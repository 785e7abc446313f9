"""Tensor and pipeline parallelism for the new families: greedy tokens identical to one rank
(fp32) under the stress configuration, with degrees that divide neither the heads nor the
intermediate size, as tests/e2e/test_tensor_parallel.py and test_pipeline_parallel.py do for
Llama (the families with a layout of their own: test_family_pipeline.py)."""

from __future__ import annotations

import pytest

from bladellm import LLM, SamplingParams
from family_models import family_dirs
from test_family_engine import _prompts


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    return family_dirs(tmp_path_factory)


STRESS = dict(dtype="float32", block_size=4, max_num_batched_tokens=32, max_num_seqs=8,
              num_kv_blocks=40, max_model_len=128, debug_block_accounting=True)
# variant -> (tensor_parallel_size, pipeline_parallel_size)
CASES = {"opt-uneven": (3, 1), "glm4-uneven": (3, 1), "phi3-longrope": (2, 1),
         "chatglm": (2, 1), "glm4": (1, 2), "phi3-partial-rotary": (1, 2)}


def _greedy(model_dir: str, tp: int, prompts: list[list[int]], pp: int = 1):
    llm = LLM(model=model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp, **STRESS)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12),
                            use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.engine.core.scheduler.get_stats()
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(CASES))
def test_greedy_identical_to_one_rank(family_dir, variant):
    model_dir = family_dir(variant)
    prompts = _prompts(300)[:8]
    want, _ = _greedy(model_dir, 1, prompts)
    got, stats = _greedy(model_dir, *CASES[variant][:1], prompts, pp=CASES[variant][1])
    assert got == want
    assert stats.num_preemptions > 0 and stats.num_used_blocks == 0

