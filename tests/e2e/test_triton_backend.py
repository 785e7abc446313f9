"""``--attn_cls triton``: the whole engine with the Triton KV store and paged attention (under
``TRITON_INTERPRET=1`` without a GPU, set by tests/conftest.py) gives the greedy tokens of the
PyTorch reference backend, with chunked prefill and prompt-cache hits; without a GPU and without
the interpreter the flag (and ``--kernels triton``) is refused naming itself."""

from __future__ import annotations

import pytest

from bladellm import LLM, SamplingParams

pytest.importorskip("triton")

OPTS = dict(dtype="float32", block_size=4, max_num_batched_tokens=16, max_model_len=64,
            num_kv_blocks=40)
# The second and third prompts share the first's first 8 tokens (prompt-cache hits); 19 and 13
# tokens do not fit one 16-token step (chunked prefill).
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 9, 10, 11, 12, 40, 41, 42, 43, 44, 45,
                                             46, 47, 48, 49, 50],
           [5, 6, 7, 8, 9, 10, 11, 12, 60, 61, 62, 63, 64]]


def _greedy(model: str, attn_cls: str, **kwargs) -> tuple[list[list[int]], int, str]:
    """Greedy tokens, prompt-cache hits and the name of the kernel set the worker resolved."""
    llm = LLM(model=model, attn_cls=attn_cls, **OPTS, **kwargs)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6,
                                                    ignore_eos=True), use_tqdm=False)
        hits = llm.engine.core.scheduler.get_stats().prefix_cache_hits
        kernels = llm.engine.core.executor.worker.kernels.name
        return [list(o.outputs[0].token_ids) for o in outs], hits, kernels
    finally:
        llm.shutdown()


def test_triton_backend_tokens_equal_the_reference(tiny_llama):
    want, _, _ = _greedy(tiny_llama, "torch")
    got, hits, kernels = _greedy(tiny_llama, "triton")
    assert got == want
    assert hits > 0
    assert kernels == "triton"  # --kernels auto resolves to the set the backend needs


def test_triton_backend_refused_on_cpu_without_the_interpreter(tiny_llama, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="--attn_cls triton"):
        LLM(model=tiny_llama, attn_cls="triton", dtype="float32")
    with pytest.raises(ValueError, match="--kernels triton"):
        LLM(model=tiny_llama, kernels="triton", dtype="float32")


def test_whole_model_through_the_triton_kernel_set(tiny_llama):
    """``--kernels triton`` (chosen per worker, so in this process beside a compiled engine):
    attention, KV store, RMSNorm, rotary and SiLU-and-mul of every layer run as Triton kernels;
    greedy tokens equal those of ``--kernels auto`` (compiled CPU kernels)."""
    want, _, _ = _greedy(tiny_llama, "auto")
    got, _, kernels = _greedy(tiny_llama, "auto", kernels="triton")
    assert kernels == "triton"
    assert got == want
