"""Quantized checkpoints end to end: the offline LLM decodes greedily what transformers decodes
with the fake-quantized weights; TP=2 (shards on group boundaries) gives the tokens of one rank;
the server serves a quantized checkpoint to the openai client; a contradicting --quantization is
refused while the model is resolved, before any process starts."""

from __future__ import annotations

import signal
import subprocess

import openai
import pytest
import torch
import transformers

from bladellm import LLM, SamplingParams
from quant_checkpoints import quantize_checkpoint
from test_server import ServerProcess

MAX_TOKENS = 12
PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46], [100, 12]]


@pytest.fixture(scope="module")
def quantized(tiny_llama, tmp_path_factory):
    cache = {}

    def get(fmt: str, **kwargs):
        key = (fmt, tuple(sorted(kwargs.items())))
        if key not in cache:
            d = tmp_path_factory.mktemp(fmt)
            cache[key] = (str(d), quantize_checkpoint(tiny_llama, d, fmt, **kwargs))
        return cache[key]
    return get


def _generate(model_dir: str, **kwargs) -> list[list[int]]:
    llm = LLM(model=model_dir, dtype="float32", max_model_len=128, **kwargs)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                    ignore_eos=True), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


@torch.no_grad()
def _reference_greedy(float_dir: str, fake: dict[str, torch.Tensor]) -> list[list[int]]:
    ref = transformers.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
    ref.load_state_dict({**ref.state_dict(), **fake})
    out = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        gen = ref.generate(ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                           do_sample=False)
        out.append(gen[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("fmt,kwargs", [("gptq", dict(bits=4, group_size=32)),
                                        ("awq", dict(group_size=32)),
                                        ("ct-pack", dict(bits=4, group_size=32, sym=True))])
def test_offline_greedy_matches_the_fake_quantized_model(tiny_llama, quantized, fmt, kwargs):
    model_dir, fake = quantized(fmt, **kwargs)
    assert _generate(model_dir) == _reference_greedy(tiny_llama, fake)


@pytest.mark.slow  # ~40 s: two worker processes plus a one-rank run
def test_tensor_parallel_2_matches_one_rank(quantized):
    model_dir, _ = quantized("gptq", bits=4, group_size=32)
    assert _generate(model_dir, tensor_parallel_size=2) == _generate(model_dir)


@pytest.mark.slow  # ~40 s: a server subprocess start
def test_server_serves_a_w8a8_checkpoint(quantized):
    model_dir, _ = quantized("ct-w8a8")
    srv = ServerProcess(["--model", model_dir, "--served_model_name", "tiny-w8a8",
                         "--host", "127.0.0.1", "--port", "0", "--dtype", "float32",
                         "--max_model_len", "128", "--num_kv_blocks", "64",
                         "--quantization", "compressed-tensors", "--num_threads", "1"])
    try:
        url = srv.wait_ready(timeout=240)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        resp = client.completions.create(model="tiny-w8a8", prompt="The quick brown fox",
                                         max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert resp.usage.completion_tokens == 6 and resp.choices[0].text
    finally:
        if srv.proc.poll() is None:
            srv.proc.send_signal(signal.SIGTERM)
            try:
                srv.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                srv.proc.kill()


def test_a_contradicting_quantization_flag_is_refused_before_any_process(quantized):
    from bladellm.config import ModelConfig
    from bladellm.model.loader import resolve_model

    model_dir, _ = quantized("awq", group_size=32)
    with pytest.raises(ValueError, match="--quantization gptq.*awq"):
        resolve_model(ModelConfig(model=model_dir, quantization="gptq"))
    assert resolve_model(ModelConfig(model=model_dir, quantization="awq")).path == model_dir
