"""``blade_llm_quantize`` on mixture-of-experts models → serve: GPTQ checkpoints written per
expert under the checkpoint's own names (Mixtral's ``block_sparse_moe.experts.{e}.w1``), routers
left float; the engine's greedy tokens equal transformers running the weights read back by the
independent unpacker (tests/unit/quantization_tool/reference.py); calibration tokens are counted
per expert, and experts no token reached are quantized by min-max round-to-nearest and named;
GPTQ's per-expert Hessians beat min-max on the layer outputs; perplexity stays near float's."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

from bladellm import LLM, SamplingParams
from bladellm.entrypoints.cli.quantize import main as quantize_main, run as quantize_run
from bladellm.checkpoint.moe import num_experts
from bladellm.quantization.algorithms.quantizer import GroupQuantSpec, rtn_quantize
from bladellm.quantization.calib import load_calibration_texts, tokenize_calibration
from quant_checkpoints import MOE_SHAPES, dequantized_checkpoint
from tiny_models import CORPUS
from unit.quantization_tool.reference import dequantize_gptq, read_checkpoint

PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46], [100, 12, 13]]
MAX_TOKENS = 10
BLOCKS = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
          "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
          "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"))}


def _calib(tmp_path: Path) -> str:
    path = tmp_path / "calib.txt"
    path.write_text("\n\n".join(CORPUS[:10] * 4))
    return str(path)


def _args(model: str, out: str, calib: str, algo: str = "gptq", samples: int = 6,
          max_len: int = 32) -> list[str]:
    args = ["--model", model, "--output_dir", out, "--quant_algo", algo, "--bit", "4",
            "--group_size", "32"]
    if algo != "minmax":
        args += ["--calib_data", calib, "--calib_data_max_len", str(max_len),
                 "--num_calib_samples", str(samples)]
    return args


def read_back(src: str, qdir: str, arch: str, dst: Path) -> str:
    """The float checkpoint of ``src`` with every quantized linear replaced by its weights
    read back from ``qdir`` by the independent unpacker."""
    t = read_checkpoint(qdir)
    fake = {f"{p[:-len('.qweight')]}.weight": dequantize_gptq(t, p[:-len(".qweight")], 4)
            for p in t if p.endswith(".qweight")}
    return dequantized_checkpoint(src, fake, dst)


@torch.no_grad()
def _greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        for _ in range(MAX_TOKENS):
            nxt = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        out.append(ids[0, len(p):].tolist())
    return out


@torch.no_grad()
def _perplexity(model_dir: str, text: str) -> float:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tok(text, return_tensors="pt").input_ids[:, :256]
    return math.exp(model(ids, labels=ids).loss.item())


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_quantized_moe_serves_the_read_back_tokens(tiny_model_factory, tmp_path, arch, capsys):
    src = tiny_model_factory(arch, **MOE_SHAPES[arch])
    out = str(tmp_path / "q")
    assert quantize_main(_args(src, out, _calib(tmp_path))) == 0
    assert "calibration tokens per expert" in capsys.readouterr().out
    t = read_checkpoint(out)
    block, (gate, up, down) = BLOCKS[arch]
    experts = num_experts(SimpleNamespace(**json.loads((Path(src) / "config.json").read_text())))
    for e in range(experts):
        for part in (gate, up, down):
            assert f"model.layers.1.{block}.experts.{e}.{part}.qweight" in t
    assert t[f"model.layers.1.{block}.gate.weight"].dtype.is_floating_point  # the router
    if arch == "qwen2_moe":
        assert "model.layers.1.mlp.shared_expert.gate_proj.qweight" in t
        assert "model.layers.1.mlp.shared_expert_gate.weight" in t
    llm = LLM(model=out, dtype="float32", max_model_len=128)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                    ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    ref_dir = read_back(src, out, arch, tmp_path / "ref")
    ref = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)
    assert [list(o.outputs[0].token_ids) for o in outs] == _greedy(ref.eval(), PROMPTS)
    # 4-bit groups of 32 on a tiny random model: perplexity on the calibration domain near
    # float's.
    text = " ".join(CORPUS[10:20])
    assert _perplexity(ref_dir, text) < 1.1 * _perplexity(src, text)


@pytest.mark.slow  # two quantizations and two read-backs: ~30 s
@torch.no_grad()
def test_gptq_beats_minmax_on_the_experts(tiny_model_factory, tmp_path):
    """GPTQ on per-expert Hessians: the model's logits on the calibration data closer to
    float than min-max's (what tests/unit/quantization_tool/test_accuracy.py judges)."""
    src = tiny_model_factory("qwen3_moe", **MOE_SHAPES["qwen3_moe"])
    calib = _calib(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(src)
    samples = tokenize_calibration(tok, load_calibration_texts(calib), 32, 6)
    float_model = transformers.AutoModelForCausalLM.from_pretrained(src)
    errors = {}
    for algo in ("minmax", "gptq"):
        out = str(tmp_path / algo)
        assert quantize_main(_args(src, out, calib, algo)) == 0
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            read_back(src, out, "qwen3_moe", tmp_path / f"{algo}-ref"))
        errors[algo] = sum((ref(ids).logits - float_model(ids).logits).pow(2).mean().item()
                           for ids in samples)
    assert errors["gptq"] < errors["minmax"], errors


def test_experts_no_token_reached_fall_back_to_minmax(tiny_model_factory, tmp_path):
    # 16 experts, one per token, and one calibration sample of 4 tokens: at most 4 experts
    # of each layer see a token.
    src = tiny_model_factory("qwen3_moe", **MOE_SHAPES["qwen3_moe"], num_experts=16,
                             num_experts_per_tok=1)
    out = str(tmp_path / "q")
    report = quantize_run(_args(src, out, _calib(tmp_path), samples=1, max_len=4))
    assert set(report.expert_tokens) == {"model.layers.0.mlp.experts",
                                         "model.layers.1.mlp.experts"}
    for counts in report.expert_tokens.values():
        assert len(counts) == 16 and sum(counts) == 4  # every token counted once
    missed = [f"{layer}.{e}" for layer, counts in report.expert_tokens.items()
              for e, n in enumerate(counts) if n == 0]
    assert len(missed) >= 24 and report.uncalibrated_experts == missed
    meta = json.loads((Path(out) / "config.json").read_text())["quantization_config"]["meta"]
    assert meta["uncalibrated_experts"] == missed and "round-to-nearest" in \
        meta["uncalibrated_experts_rule"]
    # The stated rule: those experts' weights are exactly min-max RTN of the float ones.
    float_model = transformers.AutoModelForCausalLM.from_pretrained(src)
    t = read_checkpoint(out)
    spec = GroupQuantSpec(4, 32, sym=True)  # the CLI default
    for name in missed[:3]:
        layer, e = int(name.split(".")[2]), int(name.rsplit(".", 1)[1])
        stacked = float_model.model.layers[layer].mlp.experts
        inter = stacked.down_proj.shape[2]
        for part, w in (("gate_proj", stacked.gate_up_proj[e, :inter]),
                        ("down_proj", stacked.down_proj[e])):
            got = dequantize_gptq(t, f"{name}.{part}", 4)
            torch.testing.assert_close(got, rtn_quantize(w.detach(), spec).dequantize(),
                                       atol=1e-3, rtol=0)  # scales stored as fp16
    llm = LLM(model=out, dtype="float32", max_model_len=64)  # and it serves
    llm.shutdown()


@pytest.mark.parametrize("flags, match", [
    (["--cpu_offload"], "--cpu_offload: not supported for the mixture-of-experts"),
])
def test_unsupported_moe_combinations_are_refused(tiny_model_factory, tmp_path, flags, match):
    src = tiny_model_factory("qwen3_moe", **MOE_SHAPES["qwen3_moe"])
    args = _args(src, str(tmp_path / "q"), _calib(tmp_path))
    if flags[0] == "--quant_algo":
        args[args.index("--quant_algo") + 1] = flags[1]
    else:
        args += flags
    with pytest.raises(ValueError, match=match):
        quantize_run(args)
    assert not (tmp_path / "q").exists()


def test_missing_expert_tensor_refused_before_any_work(tiny_model_factory, tmp_path):
    """transformers would initialize a missing expert at random and it would be quantized."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(tiny_model_factory("mixtral"), src)
    state = load_file(str(src / "model.safetensors"))
    del state["model.layers.1.block_sparse_moe.experts.2.w2.weight"]
    save_file(state, str(src / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*block_sparse_moe\.experts\.2\.w2"):
        quantize_run(_args(str(src), str(tmp_path / "q"), _calib(tmp_path)))
    assert not (tmp_path / "q").exists()
