"""GPTQ / AWQ checkpoints of the new families, quantized module by module as AutoGPTQ / AutoAWQ
write them (tests/quant_checkpoints.py) — OPT's q/k/v, out_proj, fc1, fc2; Phi-3's and GLM-4's
fused qkv_proj / gate_up_proj as one quantized module each, as their checkpoints store them;
Gemma 2 / 3's Llama-named modules; Bloom's query_key_value (rows per head, split at load in
packed units), dense, dense_h_to_4h, dense_4h_to_h: logits match transformers running the
fake-quantized weights (eager attention: its SDPA path skips Gemma 2's soft-cap)."""

from __future__ import annotations

import pytest
import torch

import quant_checkpoints
from bladellm.attention import get_attn_backend
from bladellm.checkpoint.hf_config import load_hf_config
from bladellm.config import ModelConfig
from bladellm.model.loader import load_model
from family_models import family_dirs
from quant_checkpoints import quantize_checkpoint
from test_quantized_parity import _close
from tiny_paged_kv import PagedKV, Seq
from window_family_models import make_window_family_model

WINDOW_FAMILIES = ("gemma2", "gemma3", "bloom")


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    families = family_dirs(tmp_path_factory)
    cache: dict = {}

    def get(variant: str) -> str:
        if variant not in WINDOW_FAMILIES:
            return families(variant)
        if variant not in cache:
            cache[variant] = make_window_family_model(tmp_path_factory.mktemp(variant), variant)
        return cache[variant]

    return get


def _reference(float_dir: str, fake: dict[str, torch.Tensor]):
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32,
                                                            attn_implementation="eager")
    state = ref.state_dict()
    if not any(k in state for k in fake):  # saved from the base model (Bloom: no transformer.)
        fake = {f"{ref.base_model_prefix}.{k}": v for k, v in fake.items()}
    assert set(fake) <= set(state)
    ref.load_state_dict({**state, **fake})
    return ref.eval()


def _load(model_dir: str, kernels):
    return load_model(ModelConfig(model=model_dir), load_hf_config(model_dir, False),
                      torch.float32, "cpu", get_attn_backend(None, kernels))


LINEARS = {"opt": ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),
           "phi3-longrope": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
           "glm4": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"),
           "gemma2": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                      "down_proj"),
           "gemma3": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                      "down_proj"),
           "bloom": ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")}
CASES = {"gptq": dict(fmt="gptq", bits=4, group_size=32, sym=False),
         "awq": dict(fmt="awq", group_size=32)}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("variant", list(LINEARS))
@torch.no_grad()
def test_quantized_logits(family_dir, tmp_path, variant, case, layer_kernels, monkeypatch):
    monkeypatch.setattr(quant_checkpoints, "LINEARS", LINEARS[variant])
    src = family_dir(variant)
    fake = quantize_checkpoint(src, tmp_path, **CASES[case])
    assert len({name.rsplit(".", 2)[-2] for name in fake}) == len(LINEARS[variant])
    ours = _load(str(tmp_path), layer_kernels)
    ref = _reference(src, fake)
    ids = torch.randint(3, ref.config.vocab_size, (13,), generator=torch.Generator().manual_seed(0))
    kv = PagedKV(ours.get_kv_cache_spec(), num_blocks=32, block_size=4)
    seq = Seq()
    ctx, pos = kv.step([seq], [len(ids)])
    _close(ours.compute_logits(ours(ids, pos, ctx)), ref(ids[None]).logits[0], False)
    tokens = ids
    for _ in range(4):
        nxt = ref(tokens[None]).logits[0, -1].argmax().view(1)
        tokens = torch.cat([tokens, nxt])
        ctx, pos = kv.step([seq], [1])
        _close(ours.compute_logits(ours(nxt, pos, ctx)), ref(tokens[None]).logits[0, -1:], False)


@pytest.mark.slow
def test_quantized_fused_checkpoint_tp2_serves_the_one_rank_tokens(family_dir, tmp_path,
                                                                 monkeypatch):
    """GLM-4's fused quantized gate_up_proj split per part, then each part per rank."""
    from bladellm import LLM, SamplingParams

    monkeypatch.setattr(quant_checkpoints, "LINEARS", LINEARS["glm4"])
    quantize_checkpoint(family_dir("glm4"), tmp_path, **CASES["gptq"])
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17], [40, 41]]
    outs = []
    for tp in (1, 2):
        llm = LLM(model=str(tmp_path), tensor_parallel_size=tp, dtype="float32",
                  max_model_len=64, num_kv_blocks=32, block_size=4)
        try:
            outs.append([o.outputs[0].token_ids for o in llm.generate(
                prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)])
        finally:
            llm.shutdown()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_quantized_chatglm_equals_quantized_glm(family_dir, tmp_path, case, layer_kernels,
                                                monkeypatch):
    """A ChatGLM checkpoint quantized module by module (fused query_key_value, dense,
    dense_h_to_4h, dense_4h_to_h) gives the logits of the same GLM weights quantized under
    GLM's names (min-max per output row: fusing rows does not change them), which
    test_quantized_logits checks against transformers."""
    glm_q, chatglm_q = tmp_path / "glm", tmp_path / "chatglm"
    monkeypatch.setattr(quant_checkpoints, "LINEARS",
                        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"))
    quantize_checkpoint(family_dir("glm-rope-ratio"), glm_q, **CASES[case])
    monkeypatch.setattr(quant_checkpoints, "LINEARS",
                        ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"))
    quantize_checkpoint(family_dir("chatglm"), chatglm_q, **CASES[case])
    ids = torch.randint(3, 200, (13,), generator=torch.Generator().manual_seed(0))
    logits = []
    for path in (glm_q, chatglm_q):
        model = _load(str(path), layer_kernels)
        kv = PagedKV(model.get_kv_cache_spec(), num_blocks=32, block_size=4)
        ctx, pos = kv.step([Seq()], [len(ids)])
        logits.append(model.compute_logits(model(ids, pos, ctx)))
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=0)
