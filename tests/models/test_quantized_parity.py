"""Quantized checkpoints vs transformers running the same model with the fake-quantized
(dequantized) weights in fp32: a prefill, then greedy decode steps through a real paged KV cache.
Weight-only formats compute the same weights, so logits agree to fp32 GEMM rounding; for W8A8 the
reference's quantized linears also fake-quantize their input per token (symmetric int8)."""

from __future__ import annotations

import pytest
import torch
import transformers

from bladellm.attention import get_attn_backend
from bladellm.config import ModelConfig
from bladellm.checkpoint.hf_config import load_hf_config
from bladellm.model.loader import load_model
from quant_checkpoints import quantize_checkpoint
from tiny_paged_kv import PagedKV, Seq

CASES = {
    "gptq-4bit-g32": dict(fmt="gptq", bits=4, group_size=32, sym=False),
    "gptq-4bit-desc_act": dict(fmt="gptq", bits=4, group_size=32, sym=True, desc_act=True),
    "gptq-8bit-channel": dict(fmt="gptq", bits=8, group_size=-1, sym=True),
    "awq-g32": dict(fmt="awq", group_size=32),
    "ct-w4a16-g32": dict(fmt="ct-pack", bits=4, group_size=32, sym=True),
    "ct-w8a8": dict(fmt="ct-w8a8"),
}
NUM_DECODE_STEPS = 6


def _fake_quant_per_token(module, args):
    x = args[0]
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127.0
    return (torch.round(x / scale).clamp(-127, 127) * scale,)


def _reference(float_dir: str, fake: dict[str, torch.Tensor], w8a8: bool):
    ref = transformers.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
    state = ref.state_dict()
    assert set(fake) <= set(state)
    ref.load_state_dict({**state, **fake})
    if w8a8:
        for name in fake:
            ref.get_submodule(name[:-len(".weight")]).register_forward_pre_hook(
                _fake_quant_per_token)
    return ref.eval()


def _close(got: torch.Tensor, want: torch.Tensor, w8a8: bool) -> None:
    # W8A8: an activation within rounding of a quantization tie may land one step apart.
    torch.testing.assert_close(got, want, atol=2e-3 if w8a8 else 2e-4, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_logits_match_the_fake_quantized_model(tiny_llama, tmp_path, case, layer_kernels):
    fake = quantize_checkpoint(tiny_llama, tmp_path, **CASES[case])
    ours = load_model(ModelConfig(model=str(tmp_path)), load_hf_config(str(tmp_path), False),
                      torch.float32, "cpu", get_attn_backend(None, layer_kernels))
    w8a8 = CASES[case]["fmt"] == "ct-w8a8"
    ref = _reference(tiny_llama, fake, w8a8)
    ids = torch.randint(3, ref.config.vocab_size, (13,), generator=torch.Generator().manual_seed(0))
    kv = PagedKV(ours.get_kv_cache_spec(), num_blocks=32, block_size=4)
    seq = Seq()
    ctx, pos = kv.step([seq], [len(ids)])
    logits = ours.compute_logits(ours(ids, pos, ctx))
    _close(logits, ref(ids[None]).logits[0], w8a8)
    tokens = ids
    for _ in range(NUM_DECODE_STEPS):  # one row: the decode-size kernels (ATen int4)
        nxt = ref(tokens[None]).logits[0, -1].argmax().view(1)
        tokens = torch.cat([tokens, nxt])
        ctx, pos = kv.step([seq], [1])
        logits = ours.compute_logits(ours(nxt, pos, ctx))
        _close(logits, ref(tokens[None]).logits[0, -1:], w8a8)
