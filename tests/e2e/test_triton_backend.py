"""``--attn_cls triton``: the whole engine with the Triton KV store and paged attention (under
``TRITON_INTERPRET=1`` without a GPU, set by tests/conftest.py) gives the greedy tokens of the
PyTorch reference backend, with chunked prefill and prompt-cache hits; without a GPU and without
the interpreter the flag is refused naming itself."""

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


def _greedy(model: str, attn_cls: str) -> tuple[list[list[int]], int]:
    llm = LLM(model=model, attn_cls=attn_cls, **OPTS)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6,
                                                    ignore_eos=True), use_tqdm=False)
        hits = llm.engine.core.scheduler.get_stats().prefix_cache_hits
        return [list(o.outputs[0].token_ids) for o in outs], hits
    finally:
        llm.shutdown()


def test_triton_backend_tokens_equal_the_reference(tiny_llama):
    want, _ = _greedy(tiny_llama, "torch")
    got, hits = _greedy(tiny_llama, "triton")
    assert got == want
    assert hits > 0


def test_triton_backend_refused_on_cpu_without_the_interpreter(tiny_llama, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="--attn_cls triton"):
        LLM(model=tiny_llama, attn_cls="triton", dtype="float32")


def test_whole_model_through_the_triton_kernel_set(tiny_llama):
    """``BLADELLM_KERNELS=triton`` (chosen once per process, so in a subprocess): attention, KV
    store, RMSNorm, rotary and SiLU-and-mul of every layer run as Triton kernels; greedy tokens
    equal this process's (compiled CPU kernels)."""
    import json
    import os
    import subprocess
    import sys

    want, _ = _greedy(tiny_llama, "auto")
    script = (
        "import json, sys\n"
        "from bladellm import LLM, SamplingParams\n"
        "from bladellm.kernels import get_kernels\n"
        f"llm = LLM(model={tiny_llama!r}, **{OPTS!r})\n"
        f"outs = llm.generate({PROMPTS!r}, SamplingParams(temperature=0.0, max_tokens=6, "
        "ignore_eos=True), use_tqdm=False)\n"
        "llm.shutdown()\n"
        "print(json.dumps({'kernels': get_kernels().name, "
        "'tokens': [list(o.outputs[0].token_ids) for o in outs]}))\n")
    env = {**os.environ, "BLADELLM_KERNELS": "triton", "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["kernels"] == "triton"
    assert result["tokens"] == want
