"""Offline throughput: bladellm vs transformers' batched generate, same model, same run.

Workload: N requests with input and output lengths drawn uniformly from the given ranges, random
prompt token ids, ``ignore_eos`` so every request produces exactly its output length. Output tok/s
counts the requested output tokens (the useful work) for both engines.

transformers runs the requests in arrival order in left-padded batches of ``--hf_batch_size``;
each batch generates max(output length in batch) tokens (that is how one ignores EOS with a
per-batch ``max_new_tokens``). Its raw generated tok/s, padding included, is reported too.

    python benchmarks/offline_throughput.py --dtype bfloat16 --num_prompts 256
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

SHAPES = {
    # 88M parameters: Llama shape with hidden 768, 12 layers, 12/4 heads, 8k vocab.
    "llama-88m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=4, vocab_size=8192,
                      max_position_embeddings=2048, tie_word_embeddings=False),
}


def make_model_dir(shape: str, path: Path) -> str:
    """Random-weight model of a real shape, with a word-level tokenizer covering every id."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = SHAPES[shape]
    if (path / "config.json").exists():
        return str(path)
    vocab = {f"t{i}": i for i in range(cfg["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2",
                                                bos_token="t1", pad_token="t0", unk_token="t0")
    config = transformers.LlamaConfig(**cfg, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    fast.save_pretrained(path)
    return str(path)


def make_workload(n: int, in_range: tuple[int, int], out_range: tuple[int, int], vocab: int,
                  seed: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(in_range[0], in_range[1] + 1, n)
    out_lens = rng.integers(out_range[0], out_range[1] + 1, n)
    prompts = [rng.integers(3, vocab, int(k)).tolist() for k in in_lens]
    return prompts, [int(x) for x in out_lens]


def run_bladellm(model_dir: str, dtype: str, prompts, out_lens, args) -> dict:
    from bladellm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=model_dir, dtype=dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory="4GiB")
    load_s = time.perf_counter() - t0
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.quiet)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(out_lens), (produced, sum(out_lens))
    return {"engine": "bladellm", "elapsed_s": elapsed, "load_s": load_s,
            "output_tokens": produced, "output_tok_s": produced / elapsed,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens}


def run_transformers(model_dir: str, dtype: str, prompts, out_lens, batch_size: int,
                     quiet: bool) -> dict:
    import transformers
    from tqdm import tqdm

    torch_dtype = getattr(torch, dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
    model.eval()
    pad = 0

    def run_batch(batch_prompts, max_new):
        width = max(len(p) for p in batch_prompts)
        ids = torch.full((len(batch_prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(batch_prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                                 min_new_tokens=max_new, do_sample=False, pad_token_id=pad)
        return (out.shape[1] - width) * len(batch_prompts)

    run_batch(prompts[:2], 4)  # warm-up
    generated = 0
    start = time.perf_counter()
    for i in tqdm(range(0, len(prompts), batch_size), disable=quiet, desc="transformers"):
        generated += run_batch(prompts[i:i + batch_size], max(out_lens[i:i + batch_size]))
    elapsed = time.perf_counter() - start
    useful = sum(out_lens)
    return {"engine": f"transformers (batch {batch_size})", "elapsed_s": elapsed,
            "output_tokens": useful, "output_tok_s": useful / elapsed,
            "generated_tokens_incl_padding": generated,
            "generated_tok_s_incl_padding": generated / elapsed, "batch_size": batch_size}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-88m", choices=sorted(SHAPES))
    ap.add_argument("--model_dir", default=None, help="Existing model dir (default: make one).")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--num_prompts", type=int, default=256)
    ap.add_argument("--input_len", default="32,256", help="uniform range, inclusive")
    ap.add_argument("--output_len", default="32,256", help="uniform range, inclusive")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max_num_seqs", type=int, default=256)
    ap.add_argument("--max_num_batched_tokens", type=int, default=2048)
    ap.add_argument("--hf_batch_size", default="32",
                    help="comma list: transformers batch sizes to run (best one is the peer)")
    ap.add_argument("--engines", default="bladellm,transformers")
    ap.add_argument("--output_json", default=None)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)

    in_range = tuple(int(x) for x in args.input_len.split(","))
    out_range = tuple(int(x) for x in args.output_len.split(","))
    model_dir = args.model_dir or make_model_dir(
        args.shape, Path(tempfile.gettempdir()) / f"bladellm-bench-{args.shape}")
    prompts, out_lens = make_workload(args.num_prompts, in_range, out_range,
                                      SHAPES[args.shape]["vocab_size"], args.seed)
    results = []
    engines = args.engines.split(",")
    if "bladellm" in engines:
        results.append(run_bladellm(model_dir, args.dtype, prompts, out_lens, args))
        print(json.dumps(results[-1]), flush=True)
    if "transformers" in engines:
        for bs in (int(x) for x in args.hf_batch_size.split(",")):
            results.append(run_transformers(model_dir, args.dtype, prompts, out_lens, bs,
                                            args.quiet))
            print(json.dumps(results[-1]), flush=True)

    import transformers
    report = {
        "shape": args.shape, "dtype": args.dtype, "num_prompts": args.num_prompts,
        "input_len": in_range, "output_len": out_range, "seed": args.seed,
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "results": results,
    }
    blade = [r for r in results if r["engine"] == "bladellm"]
    peers = [r for r in results if r["engine"] != "bladellm"]
    if blade and peers:
        best = max(peers, key=lambda r: r["output_tok_s"])
        report["speedup_vs_best_transformers"] = blade[0]["output_tok_s"] / best["output_tok_s"]
    print("\n| engine | output tok/s | elapsed s |\n|---|---|---|")
    for r in results:
        print(f"| {r['engine']} | {r['output_tok_s']:.1f} | {r['elapsed_s']:.1f} |")
    if "speedup_vs_best_transformers" in report:
        print(f"\nbladellm / best transformers: {report['speedup_vs_best_transformers']:.2f}x")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
