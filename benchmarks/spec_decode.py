"""normal vs sps vs look_ahead on the demo model (offline engine, greedy), interleaved.

    flock /tmp/bladellm-bench.lock python benchmarks/spec_decode.py --concurrency 1 4 16

Workloads: ``chat`` (short questions, free answers) and ``rag`` (a document in the prompt and
a request to repeat/summarize it: answers reuse the prompt). Concurrency c = c requests
submitted at once. The sps draft is the demo model cut to its first ``--draft_layers`` layers
(same tokenizer and vocabulary; written once to ``--draft_dir``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

DOC = ("BladeLLM keeps the KV cache in fixed-size blocks, batches requests continuously and "
       "reuses cached prompt prefixes. Speculative decoding lets a small draft model propose "
       "tokens that the target verifies in one forward pass; lookahead decoding guesses "
       "n-grams from a Jacobi window and from the prompt itself. Both keep the output of the "
       "target model unchanged. The scheduler grants every request a token budget each step. ")
CHAT = ["What is the capital of France?", "Write a haiku about the sea.",
        "Explain what a hash map is.", "Give me three tips for sleeping well.",
        "What is 17 times 23?", "Name a famous painter and one painting.",
        "How do airplanes fly?", "Tell me a fun fact about cats."]


def make_draft(path: str, layers: int) -> str:
    from safetensors.torch import save_file

    from bladellm.config import ModelConfig
    from bladellm.model.loader import resolve_model

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    resolved = resolve_model(ModelConfig(model="demo", dtype="float32"))
    cfg = resolved.hf_config
    tensors = {}
    if resolved.gguf is not None:
        weights = resolved.gguf.iter_hf_weights(torch.float32)
    else:  # the GGUF's dense copy (checkpoint/gguf_cache.py) resolves as a safetensors directory
        from safetensors.torch import load_file

        weights = ((n, t.float()) for n, t in
                   load_file(os.path.join(resolved.path, "model.safetensors")).items())
    for name, t in weights:
        if ".layers." in name and int(name.split(".layers.")[1].split(".")[0]) >= layers:
            continue
        tensors[name] = t.contiguous()
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    cfg.num_hidden_layers = layers
    cfg.save_pretrained(path)
    return path


def prompts(llm, workload: str, n: int) -> list[str]:
    if workload == "chat":
        msgs = [[{"role": "user", "content": CHAT[i % len(CHAT)]}] for i in range(n)]
    else:
        msgs = [[{"role": "user", "content": f"Document:\n{DOC * 2}\nRepeat the document "
                                             f"above word for word. ({i})"}] for i in range(n)]
    ip = llm.engine.input_processor
    return [ip.apply_chat_template(m, add_generation_prompt=True) for m in msgs]


def run_cell(llm, workload: str, c: int, params) -> dict:
    ps = prompts(llm, workload, c)
    llm.generate(ps[:1], type(params)(max_tokens=4), use_tqdm=False)  # warm
    s0 = llm.engine.core.scheduler.get_stats()
    t0 = time.perf_counter()
    outs = llm.generate(ps, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    s1 = llm.engine.core.scheduler.get_stats()
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(tok_s=ntok / dt, tbt_ms=1000 * dt / max(ntok / c, 1),
                steps=s1.num_steps - s0.num_steps,
                drafted=s1.num_spec_draft_tokens - s0.num_spec_draft_tokens,
                accepted=s1.num_spec_accepted_tokens - s0.num_spec_accepted_tokens)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--workloads", nargs="+", default=["chat", "rag"])
    ap.add_argument("--algos", nargs="+", default=["normal", "sps", "look_ahead"])
    ap.add_argument("--max_tokens", type=int, default=96)
    ap.add_argument("--draft_layers", type=int, default=6)
    ap.add_argument("--draft_dir", default="/tmp/bladellm-demo-draft")
    ap.add_argument("--draft_model", default=None,
                    help="an existing draft model directory (e.g. a 4-bit copy of the demo "
                         "model written by blade_llm_quantize) instead of the layer cut")
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--look_ahead", nargs=3, type=int, action="append", metavar=("W", "N", "G"),
                    help="look_ahead settings to compare (repeatable); default the flags' defaults")
    ap.add_argument("--kv_cache_memory", default="512MiB")
    ap.add_argument("--max_model_len", type=int, default=2048,
                    help="every engine's; the sps draft's own KV cache shares --kv_cache_memory, "
                         "so a full-depth draft halves the target's pool")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds per cell, the algorithms alternating within each round; the "
                         "table gives medians (of tok/s, and of each round's ratio to normal)")
    args = ap.parse_args()
    from bladellm import LLM, SamplingParams

    draft = None
    if "sps" in args.algos:
        draft = args.draft_model or make_draft(args.draft_dir, args.draft_layers)
    engines = {}
    for algo in args.algos:
        if algo == "look_ahead" and args.look_ahead:
            for w, n, g in args.look_ahead:
                engines[f"look_ahead(W{w},N{n},G{g})"] = LLM(
                    model="demo", decode_algo=algo, kv_cache_memory=args.kv_cache_memory,
                    max_model_len=args.max_model_len,
                    look_ahead_window_size=w, look_ahead_gram_size=n, guess_set_size=g)
            continue
        kw = {"draft_model": draft, "gamma": args.gamma} if algo == "sps" else {}
        engines[algo] = LLM(model="demo", decode_algo=algo, kv_cache_memory=args.kv_cache_memory,
                            max_model_len=args.max_model_len, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"torch {torch.__version__}, python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs; max_tokens {args.max_tokens}, greedy; draft: "
          f"{args.draft_model or f'demo model cut to {args.draft_layers} layers'}, "
          f"gamma {args.gamma}")
    rows = []
    for workload in args.workloads:
        for c in args.concurrency:
            runs: dict[str, list[dict]] = {algo: [] for algo in engines}
            for _ in range(args.repeats):
                for algo, llm in engines.items():  # interleaved: same conditions for each algo
                    runs[algo].append(run_cell(llm, workload, c, params))
                    print(json.dumps(dict(workload=workload, c=c, algo=algo, **runs[algo][-1])),
                          flush=True)
            for algo, rs in runs.items():
                ratios = [r["tok_s"] / b["tok_s"] for r, b in zip(rs, runs["normal"])] \
                    if "normal" in runs else [float("nan")]
                rows.append(dict(workload=workload, c=c, algo=algo,
                                 tok_s=statistics.median(r["tok_s"] for r in rs),
                                 tbt_ms=statistics.median(r["tbt_ms"] for r in rs),
                                 ratio=statistics.median(ratios),
                                 steps=rs[-1]["steps"], drafted=rs[-1]["drafted"],
                                 accepted=rs[-1]["accepted"]))
    print("\n| workload | conc | algo | out tok/s | x normal | mean TBT ms | steps | "
          "accepted/proposed |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        rate = f"{r['accepted']}/{r['drafted']}" if r["drafted"] else "-"
        print(f"| {r['workload']} | {r['c']} | {r['algo']} | {r['tok_s']:.1f} | "
              f"{r['ratio']:.2f} | {r['tbt_ms']:.1f} | {r['steps']} | {rate} |")


if __name__ == "__main__":
    main()
