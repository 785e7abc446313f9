"""Peak memory of ``blade_llm_quantize`` with and without ``--cpu_offload``.

Makes a random Llama of about 520 MB float32 (10 layers, hidden 1024, intermediate 2816, the
tiny test tokenizer), quantizes it with minmax 4-bit g128 both ways (the load / hold /
write path every algorithm shares; calibration activations come on top) in child processes, and
reports each child's peak RSS (``ru_maxrss``) and wall time, and whether the two checkpoints
are identical.

    python benchmarks/quant_offload_memory.py [--work_dir /tmp/qoffload]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_model(path: str) -> int:
    import torch
    import transformers

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from tiny_models import train_tokenizer

    tok = train_tokenizer()
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=1024, intermediate_size=2816, num_hidden_layers=10,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() * 4 for p in model.parameters())


def run_child(args: list[str]) -> tuple[float, float]:
    start = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    subprocess.run([sys.executable, "-m", "bladellm.entrypoints.cli.quantize", *args],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # ru_maxrss of children is the max over all waited-for children: run the smaller first
    assert peak >= before
    return peak / 1024, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work_dir", default="/tmp/qoffload")
    ns = ap.parse_args()
    model_dir = os.path.join(ns.work_dir, "model")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        size = make_model(model_dir)
    else:
        size = sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir)
                   if f.endswith(".safetensors"))
    common = ["--model", model_dir, "--quant_algo", "minmax", "--bit", "4", "--group_size", "128",
              "--overwrite"]
    off_rss, off_s = run_child(common + ["--output_dir", os.path.join(ns.work_dir, "off"),
                                         "--cpu_offload"])
    full_rss, full_s = run_child(common + ["--output_dir", os.path.join(ns.work_dir, "full")])
    import torch
    from safetensors.torch import load_file

    def tensors(d):
        out = {}
        for f in sorted(os.listdir(d)):
            if f.endswith(".safetensors"):
                out.update(load_file(os.path.join(d, f)))
        return out

    a, b = tensors(os.path.join(ns.work_dir, "off")), tensors(os.path.join(ns.work_dir, "full"))
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    print(f"model: {size / 2**20:.0f} MiB float32 weights, 10 layers of "
          f"{size / 10 / 2**20:.0f} MiB")
    print(f"--cpu_offload: peak RSS {off_rss:.0f} MiB, {off_s:.1f} s")
    print(f"whole model:   peak RSS {full_rss:.0f} MiB, {full_s:.1f} s")
    print(f"checkpoints identical: {same}")


if __name__ == "__main__":
    main()
