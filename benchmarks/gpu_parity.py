"""Greedy parity with transformers through the whole engine on one device (``--device``).

For each parity model (tests/models/test_parity.py's variants: tiny random models written here),
bladellm's offline ``LLM`` and transformers' ``generate`` decode the same random prompts
greedily on the same device:

- float32: the tokens must be identical;
- bfloat16: tokens equal up to the first divergence, and there each side's token within the
  other's top-5 (vLLM's ``check_logprobs_close`` rule); before it, every chosen token's logprob
  within ``--bf16_atol`` (default 0.1 nats) of transformers'.

Prints one line per (model, dtype) and writes a JSON summary. Exit status 1 if any case fails.

    python benchmarks/gpu_parity.py --device cuda --out gpu-out/parity.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

VARIANTS = {  # tests/models/test_parity.py
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {}),
    "llama-tied-mqa": ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    "llama-mha-head_dim32": ("llama", {"num_key_value_heads": 4, "head_dim": 32}),
}
# The default run (one device call has little time): GQA, tied embeddings with one KV head,
# and a second family (q/k norms); --variants all runs every one.
DEFAULT_VARIANTS = ("llama", "llama-tied-mqa", "qwen3")
TOP_K = 5


def free_device() -> None:
    """Hand the last case's memory back before the next one sizes its KV cache from what is
    free (the engine's worker also does this at start-up; transformers' model does not)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(k),), generator=g).tolist()
            for k in torch.randint(5, 40, (n,), generator=g)]


@torch.no_grad()
def reference(model_dir: str, dtype: torch.dtype, device: str, ids: list[list[int]],
              max_tokens: int) -> list[tuple[list[int], list[torch.Tensor]]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = model.to(device).eval()
    out = []
    for p in ids:  # one at a time: no padding in the reference
        gen = model.generate(torch.tensor([p], device=device), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)
        toks = gen.sequences[0, len(p):].tolist()
        out.append((toks, [s[0].float().log_softmax(-1).cpu() for s in gen.scores]))
    del model
    free_device()
    return out


def ours(model_dir: str, dtype: str, device: str, ids: list[list[int]],
         max_tokens: int) -> list[tuple[list[int], list[dict[int, float]]]]:
    from bladellm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=dtype, device=device, max_model_len=256,
              enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=TOP_K)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    llm.shutdown()
    del llm
    free_device()
    return [(list(o.outputs[0].token_ids),
             [{t.token_id: t.logprob for t in pos} for pos in o.outputs[0].logprobs])
            for o in outs]


def compare(ref, got, exact: bool, atol: float) -> dict:
    worst, failures = 0.0, []
    for i, ((rt, rlp), (gt, glp)) in enumerate(zip(ref, got)):
        if exact:
            if rt != gt:
                failures.append(f"prompt {i}: tokens differ at {next(j for j, (a, b) in enumerate(zip(rt, gt)) if a != b)}")
            continue
        for j, (a, b) in enumerate(zip(rt, gt)):
            if a != b:
                ref_top = rlp[j].topk(TOP_K).indices.tolist()
                if b not in ref_top or a not in glp[j]:
                    failures.append(f"prompt {i} step {j}: {b} vs {a} outside each other's "
                                    f"top-{TOP_K}")
                break
            diff = abs(float(rlp[j][a]) - glp[j][a])
            worst = max(worst, diff)
            if diff > atol:
                failures.append(f"prompt {i} step {j}: logprob differs by {diff:.4f}")
                break
    return {"ok": not failures, "max_logprob_diff": worst, "failures": failures[:5]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help=f"comma-separated, or 'all': {', '.join(VARIANTS)}")
    ap.add_argument("--num_prompts", type=int, default=4)
    ap.add_argument("--max_tokens", type=int, default=24)
    ap.add_argument("--bf16_atol", type=float, default=0.1)
    ap.add_argument("--out")
    args = ap.parse_args()
    from tiny_models import make_tiny_model

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
        for name in names:
            arch, overrides = VARIANTS[name]
            model_dir = make_tiny_model(os.path.join(tmp, name), arch, **overrides)
            from transformers import AutoConfig

            vocab = AutoConfig.from_pretrained(model_dir).vocab_size
            ids = prompts(vocab, args.num_prompts, seed=len(results))
            for dtype in args.dtypes.split(","):
                start = time.perf_counter()
                try:
                    ref = reference(model_dir, getattr(torch, dtype), args.device, ids,
                                    args.max_tokens)
                    got = ours(model_dir, dtype, args.device, ids, args.max_tokens)
                    row = compare(ref, got, dtype == "float32", args.bf16_atol)
                except Exception as e:  # noqa: BLE001 - one case's failure is reported, go on
                    row = {"ok": False, "failures": [f"{type(e).__name__}: {e}"]}
                finally:
                    ref = got = None
                    free_device()
                row.update(model=name, dtype=dtype, device=args.device,
                           seconds=round(time.perf_counter() - start, 1))
                results.append(row)
                if args.out:  # after every case: a run cut off still reports the ones done
                    Path(args.out).write_text(json.dumps(results, indent=1))
                print(f"parity {name:22s} {dtype:9s} {'OK  ' if row['ok'] else 'FAIL'} "
                      f"max|dlogprob| {row.get('max_logprob_diff', float('nan')):.4f} "
                      f"{'; '.join(row['failures'])}", flush=True)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
