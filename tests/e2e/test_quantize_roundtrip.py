"""``blade_llm_quantize`` → serve: checkpoints our tool writes load unchanged in the engine (GPTQ
v1 with act-order, AWQ-smoothed GPTQ, SmoothQuant W8A8 compressed-tensors), and the engine's
greedy tokens equal transformers running the weights read back by an independent unpacker
(tests/unit/quantization_tool/reference.py), activations fake-quantized per token for W8A8."""

from __future__ import annotations

import pytest
import torch

from bladellm import LLM, SamplingParams
from bladellm.entrypoints.cli.quantize import main as quantize_main

from tiny_models import CORPUS
from unit.quantization_tool.helpers import fake_quant_model

PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46], [100, 12, 13]]
MAX_TOKENS = 10

CASES = {
    "gptq-4bit-g32-act_order": ["--quant_algo", "gptq", "--bit", "4", "--group_size", "32",
                                "--act_order"],
    "awq-4bit-g32": ["--quant_algo", "awq", "--bit", "4", "--group_size", "32"],
    "smoothquant-w8a8": ["--quant_algo", "smoothquant", "--bit", "8", "--group_size", "-1"],
}


@torch.no_grad()
def _reference(model, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        for _ in range(MAX_TOKENS):
            nxt = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        out.append(ids[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_by_our_tool_serves_the_fake_quantized_tokens(tiny_llama, tmp_path, case):
    calib = tmp_path / "calib.txt"
    calib.write_text("\n\n".join(CORPUS[:10] * 4))
    out = str(tmp_path / "q")
    assert quantize_main(["--model", tiny_llama, "--output_dir", out, "--calib_data",
                          str(calib), "--calib_data_max_len", "32", "--num_calib_samples", "6",
                          *CASES[case]]) == 0
    llm = LLM(model=out, dtype="float32", max_model_len=128)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                    ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    got = [list(o.outputs[0].token_ids) for o in outs]
    want = _reference(fake_quant_model(tiny_llama, out, w8a8="smoothquant" in case), PROMPTS)
    assert got == want
