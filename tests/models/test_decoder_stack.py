"""The compiled decoder stack (model/decoder_stack.py) against the modules it replaces: the same
kernels in the same order, so every step's hidden states and KV cache must be bit-identical,
for batches of mixed query lengths (decodes, verification runs, short prefill chunks)."""

from __future__ import annotations

import pytest
import torch

from bladellm.attention import get_attn_backend
from bladellm.config import ModelConfig
from bladellm.kernels import resolve_kernels
from bladellm.kernels.compiled import (LINEAR_MAX_ROWS_PANEL, LINEAR_PAIRS, LINEAR_PANEL_BF16,
                                       LINEAR_ROWS_BF16, CompiledKernels)
from bladellm.kernels.scope import building_with
from bladellm.model.decoder_stack import CompiledDecoderStack
from bladellm.checkpoint.hf_config import load_hf_config
from bladellm.model.loader import load_model
from tiny_paged_kv import PagedKV, Seq

# What a CPU worker resolves for --kernels auto (one shared build per process).
KERNELS = resolve_kernels("auto", "cpu")
pytestmark = pytest.mark.skipif(not isinstance(KERNELS, CompiledKernels),
                                reason="the compiled CPU kernels are not built here")


@pytest.fixture(params=["panel", "rows"])
def layout(request, monkeypatch) -> str:
    """fp32 linears on panel-packed weights and bf16 ones on pair panels (AVX2 machines) or on
    rows with a oneDNN copy (elsewhere): the stack must mirror either, on every machine. Set
    before loading."""
    rows = LINEAR_MAX_ROWS_PANEL if request.param == "panel" else 0
    monkeypatch.setattr(KERNELS, "linear_max_rows_panel", rows)
    monkeypatch.setattr(KERNELS, "linear_max_rows_pairs", rows)
    return request.param


def load(model_dir: str, dtype: torch.dtype):
    cfg = load_hf_config(model_dir, trust_remote_code=False)
    with building_with(KERNELS):
        model = load_model(ModelConfig(model=model_dir), cfg, dtype, "cpu",
                           get_attn_backend(None, KERNELS))
    prepack(model)
    return model


def prepack(model) -> None:
    """What the runner does after loading: the linears' prepacked forms."""
    for m in model.modules():
        method = getattr(m, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(m)


def run_both(model, steps: list[list[int]], dtype: torch.dtype, block_size: int = 4,
             seed: int = 0, num_blocks: int = 64) -> int:
    """Runs each step (query length per sequence) through the stack and through the modules on
    two identical caches; asserts equal outputs and caches. Returns the steps the stack took."""
    inner = model.model
    stack = CompiledDecoderStack.build(inner, KERNELS)
    assert stack is not None
    spec = model.get_kv_cache_spec()
    kv_a = PagedKV(spec, num_blocks=num_blocks, block_size=block_size, dtype=dtype, seed=seed)
    kv_b = PagedKV(spec, num_blocks=num_blocks, block_size=block_size, dtype=dtype, seed=seed)
    seqs_a = [Seq() for _ in steps[0]]
    seqs_b = [Seq() for _ in steps[0]]
    gen = torch.Generator().manual_seed(seed)
    taken = 0
    for query_lens in steps:
        ids = torch.randint(3, model.hf_config.vocab_size, (sum(query_lens),), generator=gen)
        ctx_a, pos_a = kv_a.step(seqs_a, query_lens)
        ctx_b, pos_b = kv_b.step(seqs_b, query_lens)
        inner.compiled_stack = stack
        out_a = model(ids, pos_a, ctx_a)
        inner.compiled_stack = None
        out_b = model(ids, pos_b, ctx_b)
        assert torch.equal(out_a, out_b), (query_lens, (out_a - out_b).abs().max())
        taken += sum(query_lens) <= stack.max_rows
    for ca, cb in zip(kv_a.caches, kv_b.caches):
        assert torch.equal(ca, cb)
    return taken


# Prefill chunks, then decodes and verification runs (1 + k). The GEMV row limit is as low as 2
# (bf16 without native bf16 dot products), so three of the steps are two decodes.
STEPS = [[5, 3], [1, 1], [2, 1], [1, 1], [1, 4], [1, 1], [9, 2]]


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),
    ("qwen2", {"tie_word_embeddings": True}),  # bias on q/k/v
    ("llama", {"num_key_value_heads": 1, "hidden_size": 128, "num_attention_heads": 4}),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stack_matches_modules(tiny_model_factory, layout, arch, overrides, dtype):
    model = load(tiny_model_factory(arch, **overrides), dtype)
    stack = CompiledDecoderStack.build(model.model, KERNELS)
    if layout == "panel" and dtype == torch.bfloat16:
        assert stack.layer_args[0].qkv.kind == LINEAR_PAIRS
    taken = run_both(model, STEPS, dtype)
    assert taken >= 3  # the steps within the GEMV row limit went through the stack
    if layout == "panel":
        assert taken == len(STEPS)


def test_stack_matches_modules_with_bf16_exact_fp32_weights(tiny_model_factory, layout):
    """fp32 weights that hold only bf16 values: both paths read the bf16 copy."""
    model = load(tiny_model_factory("llama"), torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    prepack(model)
    stack = CompiledDecoderStack.build(model.model, KERNELS)
    want = LINEAR_PANEL_BF16 if layout == "panel" else LINEAR_ROWS_BF16
    assert stack is not None and stack.layer_args[0].qkv.kind == want
    assert run_both(model, STEPS, torch.float32) >= 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_busy_server_steps_run_in_the_stack(tiny_model_factory, layout, dtype):
    """Steps of a busy server (dozens of decodes beside a prefill chunk: over 64 rows) run as
    one call on panel-packed weights (fp32) or pair panels (bf16), bit-identical to the
    modules."""
    if layout != "panel":
        pytest.skip("the panel layouts only")
    model = load(tiny_model_factory("llama"), dtype)
    steps = [[40] + [3] * 30, [97] + [1] * 30, [1] * 31, [130] + [1] * 30]
    assert run_both(model, steps, dtype, num_blocks=256) == len(steps)


def test_steps_over_the_row_limit_run_the_modules(tiny_model_factory, layout):
    model = load(tiny_model_factory("llama"), torch.float32)
    stack = CompiledDecoderStack.build(model.model, KERNELS)
    calls = []
    real = stack.kernels.decoder_stack
    stack.kernels = type("Spy", (), {"decoder_stack": lambda self, a: (calls.append(a.tokens),
                                                                       real(a))})()
    spec = model.get_kv_cache_spec()
    kv = PagedKV(spec, num_blocks=128, block_size=4)
    seqs = [Seq()]
    model.model.compiled_stack = stack
    big = stack.max_rows + 1
    ctx, pos = kv.step(seqs, [big])
    model(torch.arange(3, 3 + big), pos, ctx)
    assert calls == []
    ctx, pos = kv.step(seqs, [1])
    model(torch.tensor([5]), pos, ctx)
    assert calls == [1]


def test_layouts_it_does_not_take(tiny_model_factory):
    kernels = KERNELS
    qwen3 = load(tiny_model_factory("qwen3"), torch.float32)
    assert CompiledDecoderStack.build(qwen3.model, kernels) is None  # q/k norms
    llama = load(tiny_model_factory("llama"), torch.float32)
    from bladellm.kernels.interface import Kernels
    assert CompiledDecoderStack.build(llama.model, Kernels()) is None  # reference kernels


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_uses_it_unless_enforce_eager(tiny_model_factory, dtype):
    """End to end: the engine attaches the stack (and --enforce_eager keeps the modules), and
    greedy tokens are the same either way, with decodes batched and a prefill chunked (bf16:
    on pair panels where the machine packs them)."""
    from bladellm import LLM, SamplingParams

    model_dir = tiny_model_factory("llama")
    prompts = [[5 + i, 9, 17 + 2 * i, 30, 41 + i] * (1 + i % 3) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens, stacks = [], []
    for eager in (False, True):
        llm = LLM(model=model_dir, dtype=dtype, enforce_eager=eager, max_num_seqs=4,
                  max_num_batched_tokens=16, block_size=4)
        runner = llm.engine.core.executor.worker.model_runner
        stacks.append(runner.model.model.compiled_stack)
        tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                   use_tqdm=False)])
        llm.shutdown()
    assert stacks[0] is not None and stacks[1] is None
    assert tokens[0] == tokens[1]


def test_engine_with_lora_keeps_the_modules(tiny_model_factory):
    """LoRA wraps the linears (per-token adapters the stack cannot apply): no stack, no error."""
    from bladellm import LLM

    llm = LLM(model=tiny_model_factory("llama"), dtype="float32", enable_lora=True)
    try:
        runner = llm.engine.core.executor.worker.model_runner
        assert runner.model.model.compiled_stack is None
    finally:
        llm.shutdown()
