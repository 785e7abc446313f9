"""Perplexity of float vs ``blade_llm_quantize`` checkpoints (docs/quantization_tool.md).

The quantized checkpoint is read back from disk, unpacked exactly (GPTQ v1 or compressed-tensors
int-quantized) and dequantized into the transformers model (fake quantization; W8A8 also
quantizes each linear's input per token to int8), then scored with transformers.

Text that ships on the machine: the Vim user manual (``/usr/share/vim/vim90/doc/usr_*.txt``,
vim-runtime). Held-out evaluation text: chapters 01-12, the first ``--eval_tokens`` tokens,
in non-overlapping windows of ``--window`` tokens. Calibration text: chapters 20-32 (disjoint).

    python benchmarks/quant_accuracy.py                          # the demo model (SmolLM2-135M)
    python benchmarks/quant_accuracy.py --model DIR --algos gptq,awq
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VIM_DOC = "/usr/share/vim/vim90/doc"
EVAL_CHAPTERS = range(1, 13)
CALIB_CHAPTERS = range(20, 33)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# algo -> weight bits (smoothquant: W8A8 per channel; the others use --group_size)
RUNS = {"minmax": 4, "gptq": 4, "awq": 4, "smoothquant": 8, "smoothquant+": 4}


def chapters(numbers) -> list[str]:
    out = []
    for n in numbers:
        for path in sorted(glob.glob(f"{VIM_DOC}/usr_{n:02d}.txt")):
            with open(path, encoding="utf-8", errors="replace") as f:
                out.append(f.read())
    if not out:
        raise SystemExit(f"no Vim user manual under {VIM_DOC} (apt-get install vim-runtime)")
    return out


def demo_hf_dir(work_dir: str) -> str:
    from bladellm.checkpoint.demo import demo_model_path
    from bladellm.checkpoint.gguf import save_as_hf_dir

    out = os.path.join(work_dir, "smollm2-135m-f32")
    if not os.path.isfile(os.path.join(out, "config.json")):
        save_as_hf_dir(demo_model_path(), out, "float32")
    return out


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per = 32 // bits
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = (torch.arange(per) * bits).view(1, per, 1)
    return ((words.unsqueeze(1) >> shifts) & (2 ** bits - 1)).reshape(-1, packed.shape[1])


def dequantize_linear(t: dict[str, torch.Tensor], prefix: str, qcfg: dict) -> torch.Tensor:
    """The float ``[out, in]`` weight of one quantized linear of the checkpoint."""
    if qcfg["quant_method"] == "compressed-tensors":
        return t[prefix + ".weight"].float() * t[prefix + ".weight_scale"].float()
    bits = qcfg["bits"]
    q = _unpack_rows(t[prefix + ".qweight"], bits)                 # [in, out]
    zeros = _unpack_rows(t[prefix + ".qzeros"].t(), bits).t() + 1  # [groups, out], v1
    g = t[prefix + ".g_idx"].long()
    scales = t[prefix + ".scales"].float()
    return (scales[g] * (q - zeros[g]).float()).t().contiguous()


def read_tensors(qdir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(qdir)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(qdir, f)))
    return out


@torch.no_grad()
def load_fake_quant(src: str, qdir: str):
    import transformers

    from bladellm.quantization.algorithms.quantizer import fake_quantize_act_per_token

    with open(os.path.join(qdir, "config.json")) as f:
        qcfg = json.load(f)["quantization_config"]
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    t = read_tensors(qdir)
    state = {}
    for i in range(model.config.num_hidden_layers):
        for n in LINEARS:
            prefix = f"model.layers.{i}.{n}"
            state[prefix + ".weight"] = dequantize_linear(t, prefix, qcfg)
    skip = (".qweight", ".qzeros", ".scales", ".g_idx", ".weight_scale")
    state.update({k: v.float() for k, v in t.items() if k not in state and not k.endswith(skip)})
    _, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    if qcfg["quant_method"] == "compressed-tensors":
        for layer in model.model.layers:
            for n in LINEARS:
                layer.get_submodule(n).register_forward_pre_hook(
                    lambda _m, a: (fake_quantize_act_per_token(a[0]),))
    return model.eval()


@torch.no_grad()
def eval_windows_and_calib_file(tok, work_dir: str, eval_tokens: int,
                                window: int) -> tuple[list[torch.Tensor], str, int]:
    """The held-out text's first ``eval_tokens`` tokens in windows of ``window``, the
    calibration text written to ``work_dir/calib.txt`` (its path), and how many held-out tokens
    there are (fewer than ``eval_tokens`` when the text is shorter)."""
    ids = tok("\n\n".join(chapters(EVAL_CHAPTERS)), add_special_tokens=False)["input_ids"]
    ids = ids[:eval_tokens]
    windows = [torch.tensor([ids[i:i + window]]) for i in range(0, len(ids), window)
               if len(ids[i:i + window]) > 1]
    calib = os.path.join(work_dir, "calib.txt")
    with open(calib, "w") as f:
        f.write("\n\n".join(chapters(CALIB_CHAPTERS)))
    return windows, calib, len(ids)


def perplexity(model, windows: list[torch.Tensor]) -> float:
    nll, count = 0.0, 0
    for ids in windows:
        logits = model(input_ids=ids).logits[0, :-1].float()
        nll += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        count += ids.shape[1] - 1
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--algos", default=",".join(RUNS))
    ap.add_argument("--eval_tokens", type=int, default=20480)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--group_size", type=int, default=64,
                    help="4-bit group size (SmolLM2-135M's hidden size 576 is not a multiple "
                         "of 128)")
    ap.add_argument("--num_calib_samples", type=int, default=16)
    ap.add_argument("--calib_data_max_len", type=int, default=512)
    ap.add_argument("--work_dir", default="/tmp/quant_accuracy")
    ap.add_argument("--results", default=None, help="JSON file to append each result to.")
    ns = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bladellm.quantization.algorithms.config import QuantizeConfig
    from bladellm.quantization.algorithms.pipeline import quantize_checkpoint

    os.makedirs(ns.work_dir, exist_ok=True)
    src = demo_hf_dir(ns.work_dir) if ns.model == "demo" else ns.model
    tok = AutoTokenizer.from_pretrained(src)
    windows, calib, num_eval = eval_windows_and_calib_file(tok, ns.work_dir, ns.eval_tokens,
                                                           ns.window)
    rows = []

    def record(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        if ns.results:
            with open(ns.results, "a") as f:
                f.write(json.dumps(row) + "\n")

    start = time.perf_counter()
    base = perplexity(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval(),
                      windows)
    record({"algo": "float32", "ppl": base, "eval_tokens": num_eval,
            "eval_s": time.perf_counter() - start, "torch": torch.__version__,
            "threads": torch.get_num_threads()})
    for algo in ns.algos.split(","):
        bits = RUNS[algo]
        group = -1 if algo == "smoothquant" else ns.group_size
        out = os.path.join(ns.work_dir, algo.replace("+", "plus"))
        # minmax (round to nearest) takes no calibration: its config refuses calibration sizes.
        calib_args = {} if algo == "minmax" else dict(
            calib_data=calib, calib_data_max_len=ns.calib_data_max_len,
            num_calib_samples=ns.num_calib_samples)
        cfg = QuantizeConfig(model=src, output_dir=out, quant_algo=algo, bit=bits,
                             group_size=group, **calib_args)
        report = quantize_checkpoint(cfg, progress=False)
        start = time.perf_counter()
        ppl = perplexity(load_fake_quant(src, out), windows)
        record({"algo": algo, "bits": bits, "group_size": group, "ppl": ppl,
                "delta_ppl": ppl - base, "quantize_s": report.seconds,
                "calib_tokens": report.num_calib_tokens, "checkpoint_bytes": report.weight_bytes,
                "eval_s": time.perf_counter() - start})
    print("\n| algo | weights | PPL | ΔPPL vs float32 | quantize time (s) |")
    print("|---|---|---|---|---|")
    for r in rows:
        w = "float32" if r["algo"] == "float32" else (
            f"int{r['bits']}" + (" per-channel" if r["group_size"] == -1 else
                                 f" g{r['group_size']}") + (" + int8 act" if r["algo"] ==
                                                             "smoothquant" else ""))
        print(f"| {r['algo']} | {w} | {r['ppl']:.3f} | {r.get('delta_ppl', 0):+.3f} | "
              f"{r.get('quantize_s', 0):.0f} |")


if __name__ == "__main__":
    main()
