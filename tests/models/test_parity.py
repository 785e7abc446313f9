"""fp32 logits of bladellm models vs transformers, through a real paged KV cache.

Each case: a full prefill, then 8 greedy decode steps through the cache, each compared with
transformers' full forward over the same tokens.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from bladellm.attention import get_attn_backend
from bladellm.model.forward_context import ForwardContext
from bladellm.config import ModelConfig
from bladellm.checkpoint.hf_config import load_hf_config
from bladellm.kernels import resolve_kernels
from bladellm.kernels.scope import building_with
from bladellm.model.loader import load_model
from tiny_paged_kv import PagedKV, Seq
from tiny_models import make_tiny_model

ATOL = 1e-4
NUM_DECODE_STEPS = 8


def load_both(model_dir: str, dtype: torch.dtype = torch.float32):
    cfg = load_hf_config(model_dir, trust_remote_code=False)
    kernels = resolve_kernels("auto", "cpu")  # what a CPU worker hands its model by default
    with building_with(kernels):
        ours = load_model(ModelConfig(model=model_dir), cfg, dtype, "cpu",
                          get_attn_backend(None, kernels))
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    return ours, ref


def prompt(vocab_size: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def check_prefill_then_decode(ours, ref, block_size: int = 4, prompt_len: int = 13) -> None:
    ids = prompt(ref.config.vocab_size, prompt_len)
    kv = PagedKV(ours.get_kv_cache_spec(), num_blocks=64, block_size=block_size)
    seq = Seq()
    ctx, pos = kv.step([seq], [prompt_len])
    logits = ours.compute_logits(ours(ids, pos, ctx))
    assert logits.dtype == torch.float32 and logits.shape == (prompt_len, ref.config.vocab_size)
    torch.testing.assert_close(logits, ref(ids[None]).logits[0], atol=ATOL, rtol=0)
    tokens = ids
    for _ in range(NUM_DECODE_STEPS):
        nxt = logits[-1].argmax().view(1)
        tokens = torch.cat([tokens, nxt])
        ctx, pos = kv.step([seq], [1])
        logits = ours.compute_logits(ours(nxt, pos, ctx))
        torch.testing.assert_close(logits, ref(tokens[None]).logits[0, -1:], atol=ATOL, rtol=0)


# Variants are combined to keep the number of tiny models (each ~1 s to build) small.
VARIANTS = {
    "llama": ("llama", {}),  # GQA: 4 query heads, 2 KV heads
    "mistral": ("mistral", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {}),  # Qwen3Config's default head_dim=128 != 64 / 4
    "llama-tied-mqa": ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    "llama-mha-head_dim32": ("llama", {"num_key_value_heads": 4, "head_dim": 32}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity(tiny_model_factory, variant):
    arch, overrides = VARIANTS[variant]
    ours, ref = load_both(tiny_model_factory(arch, **overrides))
    check_prefill_then_decode(ours, ref)


ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
}


@pytest.mark.parametrize("kind", list(ROPE_SCALINGS))
def test_parity_rope_scaling(tmp_path, kind):
    # Passed as the old-style rope_scaling dict; transformers 5 moves it to rope_parameters.
    model_dir = make_tiny_model(tmp_path, "llama", rope_scaling=dict(ROPE_SCALINGS[kind]),
                                rope_theta=5000.0)
    ours, ref = load_both(model_dir)
    assert ref.config.rope_parameters["rope_type"] == kind
    check_prefill_then_decode(ours, ref, block_size=16)


@pytest.mark.parametrize("block_size", [1])
def test_parity_block_sizes(tiny_model_factory, block_size):
    ours, ref = load_both(tiny_model_factory("llama"))
    check_prefill_then_decode(ours, ref, block_size=block_size, prompt_len=21)


@torch.no_grad()
def test_continuous_batch_with_chunked_prefill(tiny_model_factory):
    """Decodes and prefill chunks (with a cached prefix) share steps; each request's logits
    match transformers on its own tokens."""
    ours, ref = load_both(tiny_model_factory("qwen2", tie_word_embeddings=True))
    vocab = ref.config.vocab_size
    prompts = [prompt(vocab, 11, seed=1), prompt(vocab, 7, seed=2), prompt(vocab, 9, seed=3)]
    seqs = [Seq() for _ in prompts]
    tokens = [p.clone() for p in prompts]
    kv = PagedKV(ours.get_kv_cache_spec(), num_blocks=64, block_size=4)

    def run(plan):  # plan: [(request index, query_len)], decodes first
        reqs = [r for r, _ in plan]
        ctx, pos = kv.step([seqs[r] for r in reqs], [q for _, q in plan])
        ids = torch.cat([tokens[r][seqs[r].num_computed - q:seqs[r].num_computed]
                         for r, q in plan])
        logits = ours.compute_logits(ours(ids, pos, ctx))
        ends = ctx.attn_metadata.query_start_loc_cpu[1:]
        for (r, q), end in zip(plan, ends):
            want = ref(tokens[r][None]).logits[0, seqs[r].num_computed - q:seqs[r].num_computed]
            torch.testing.assert_close(logits[end - q:end], want, atol=ATOL, rtol=0)
            if seqs[r].num_computed == len(tokens[r]):  # prompt done: append greedy token
                tokens[r] = torch.cat([tokens[r], logits[end - 1].argmax().view(1)])

    run([(0, 5), (1, 7)])            # chunk 1 of request 0, all of request 1
    run([(1, 1), (0, 6)])            # decode 1; chunk 2 of request 0 after its cached prefix
    run([(1, 1), (0, 1), (2, 9)])    # two decodes and a new prefill in one step
    for _ in range(3):
        run([(0, 1), (1, 1), (2, 1)])


@torch.no_grad()
def test_forward_without_kv_cache(tiny_model_factory):
    """metadata=None (profiling run): plain causal attention over one sequence."""
    ours, ref = load_both(tiny_model_factory("qwen3"))
    ids = prompt(ref.config.vocab_size, 10)
    ctx = ForwardContext.no_cache()
    logits = ours.compute_logits(ours(ids, torch.arange(10), ctx))
    torch.testing.assert_close(logits, ref(ids[None]).logits[0], atol=ATOL, rtol=0)


@torch.no_grad()
def test_bfloat16_close_to_transformers(tiny_model_factory):
    ours, ref = load_both(tiny_model_factory("llama"), dtype=torch.bfloat16)
    assert next(ours.parameters()).dtype == torch.bfloat16
    ids = prompt(ref.config.vocab_size, 13)
    kv = PagedKV(ours.get_kv_cache_spec(), num_blocks=16, block_size=4, dtype=torch.bfloat16)
    ctx, pos = kv.step([Seq()], [13])
    logits = ours.compute_logits(ours(ids, pos, ctx))
    want = ref(ids[None]).logits[0].float()
    assert (logits - want).abs().max() < 0.1 * want.abs().max()
    # bf16 rounding differs with fused matmuls, so near-ties may flip: each side's greedy token
    # must be within the other's top 3.
    ours_top, want_top = logits.topk(3).indices, want.topk(3).indices
    assert (ours_top == want_top[:, :1]).any(-1).all()
    assert (want_top == ours_top[:, :1]).any(-1).all()
