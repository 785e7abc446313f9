"""KV-cache quantization: ``--kv_cache_quant int8`` against ``no_quant``, measured in one run.

--perplexity  accuracy: the demo model (SmolLM2-135M-Instruct, ``--model demo``) scores a text
              that ships with the OS (/usr/share/common-licenses: GPL-3, GFDL-1.3, Apache-2.0),
              cut into windows of --window tokens, through ``LLM(...).engine.core.
              prompt_logprobs``: a paged prefill on the engine's own KV layout, so every K/V is
              written to and read back from the (int8) cache. Reports perplexity, mean and max
              |delta logprob| per token and top-1 agreement.
--capacity    concurrent sequences at one --kv_cache_memory budget: the 88M Llama shape
              (random weights) cut to --capacity_layers layers (blocks per byte scale as
              1 / layers, so 2 layers at 4 MiB hold what 12 layers hold at 24 MiB, at a sixth
              of the compute), --capacity_requests requests of prompt + output tokens that all
              fit in max_num_seqs; reports the pool's blocks and the peak of running requests.
--decode      time between tokens of the 88M shape: B requests decoding at a context length
              (they share one prompt, so the prefill is computed once through the prompt
              cache); median step time and output tokens/s.
--kernel      the paged-attention decode kernel alone at the 88M shape (12 / 4 heads, d 64).

    python benchmarks/kv_cache_quant.py --perplexity --capacity --decode --kernel
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

QUANTS = ("no_quant", "int8")
TEXTS = ("GPL-3", "GFDL-1.3", "Apache-2.0")
LICENSES = Path("/usr/share/common-licenses")


def _88m_dir(path: str, num_layers: int = 12) -> str:
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=num_layers,
                num_attention_heads=12, num_key_value_heads=4, vocab_size=8192,
                max_position_embeddings=4096, architectures=["LlamaForCausalLM"]
                ).save_pretrained(path)
    return path


def _core(model_dir: str, **kwargs):
    from bladellm.config import EngineConfig
    from bladellm.engine.engine_core import EngineCore
    from bladellm.model.loader import resolve_model

    config = EngineConfig.from_kwargs(model=model_dir, load_format="dummy", **kwargs)
    return EngineCore(config, resolve_model(config.model))


def _add(core, req_id: str, prompt: list[int], max_tokens: int) -> None:
    from bladellm.engine.messages import EngineCoreRequest
    from bladellm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    core.add_request(EngineCoreRequest(request_id=req_id, prompt_token_ids=prompt,
                                       sampling_params=params, arrival_time=time.time()))


# ---- accuracy ---------------------------------------------------------------------------------
def perplexity(args) -> dict:
    from bladellm import LLM, SamplingParams

    text = "\n\n".join((LICENSES / name).read_text() for name in TEXTS)
    result: dict = {"texts": [str(LICENSES / n) for n in TEXTS], "window": args.window}
    lps: dict = {}
    for quant in QUANTS:
        # One generated token after each window: its prompt logprobs come from its prefill.
        llm = LLM(model="demo", dtype=args.dtype, kv_cache_quant=quant,
                  max_model_len=args.window + 1, num_kv_blocks=args.window // 16 + 3)
        ids = llm.get_tokenizer().encode(text)
        windows = [ids[i:i + args.window] for i in range(0, len(ids) - 1, args.window)]
        start = time.perf_counter()
        outs = llm.generate(windows, SamplingParams(max_tokens=1, prompt_logprobs=1),
                            use_tqdm=False)
        seconds = time.perf_counter() - start
        lps[quant] = [(e[0].logprob, e[1].token_id)  # (logprob, top-1 id)
                      for o in outs for e in o.prompt_logprobs[1:]]
        nll = -sum(lp for lp, _ in lps[quant]) / len(lps[quant])
        result[quant] = {"perplexity": math.exp(nll), "tokens": len(lps[quant]),
                         "seconds": seconds}
        llm.shutdown()
    base, quant = lps["no_quant"], lps["int8"]
    diffs = [abs(a[0] - b[0]) for a, b in zip(base, quant)]
    result["mean_abs_logprob_diff"] = sum(diffs) / len(diffs)
    result["max_abs_logprob_diff"] = max(diffs)
    result["top1_agreement"] = sum(a[1] == b[1] for a, b in zip(base, quant)) / len(base)
    result["perplexity_change_pct"] = 100 * (result["int8"]["perplexity"]
                                             / result["no_quant"]["perplexity"] - 1)
    return result


# ---- capacity ---------------------------------------------------------------------------------
def capacity(args) -> dict:
    result: dict = {"budget": args.kv_cache_memory, "requests": args.capacity_requests,
                    "prompt": args.capacity_prompt, "output": args.capacity_output,
                    "layers": args.capacity_layers}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _88m_dir(tmp, args.capacity_layers)
        for dtype in args.capacity_dtypes.split(","):
            for quant in QUANTS:
                core = _core(model_dir, dtype=dtype, kv_cache_quant=quant,
                             kv_cache_memory=args.kv_cache_memory,
                             max_num_seqs=args.capacity_requests, max_num_batched_tokens=2048,
                             max_model_len=args.capacity_prompt + args.capacity_output)
                for i in range(args.capacity_requests):
                    prompt = [(31 * i + 7 * j) % 8000 + 10 for j in range(args.capacity_prompt)]
                    _add(core, str(i), prompt, args.capacity_output)
                peak = steps = 0
                start = time.perf_counter()
                while core.scheduler.has_unfinished_requests():
                    core.step()
                    stats = core.scheduler.get_stats()
                    peak, steps = max(peak, stats.num_running), steps + 1
                result[f"{dtype}/{quant}"] = {
                    "blocks": stats.num_total_blocks, "peak_running": peak,
                    "preemptions": stats.num_preemptions, "steps": steps,
                    "seconds": time.perf_counter() - start}
                print(f"capacity {dtype}/{quant}: {result[f'{dtype}/{quant}']}", flush=True)
                core.shutdown()
    return result


# ---- decode speed -----------------------------------------------------------------------------
def decode(args) -> dict:
    """Both engines are built and prefilled, then step in turns (no_quant, int8, no_quant, ...)
    so that a busy neighbour on a shared machine slows both alike."""
    result: dict = {"batch": args.batch, "steps": args.steps, "dtype": args.dtype}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _88m_dir(tmp)
        for ctx in (int(c) for c in args.contexts.split(",")):
            cores = {}
            shared = [(7 * j) % 8000 + 10 for j in range(ctx - 1)]
            for quant in QUANTS:
                core = cores[quant] = _core(
                    model_dir, dtype=args.dtype, kv_cache_quant=quant, kv_cache_memory="2GiB",
                    num_threads=args.num_threads,
                    max_num_seqs=args.batch, max_num_batched_tokens=2048,
                    max_model_len=ctx + args.steps + 64)
                _add(core, "warm", shared + [9], 1)  # computes the shared prefix once
                while core.scheduler.has_unfinished_requests():
                    core.step()
                for i in range(args.batch):
                    _add(core, str(i), shared + [11 + i], args.steps + 16)
                for _ in range(8):  # the requests' last prompt token, then warm decode steps
                    core.step()
            times: dict = {quant: [] for quant in QUANTS}
            for _ in range(args.steps):
                for quant, core in cores.items():
                    start = time.perf_counter()
                    core.step()
                    times[quant].append(time.perf_counter() - start)
            for quant, core in cores.items():
                tbt = statistics.median(times[quant])
                result[f"ctx{ctx}/{quant}"] = {"tbt_ms": tbt * 1e3,
                                               "tokens_per_s": args.batch / tbt}
                print(f"decode ctx {ctx} {quant}: {result[f'ctx{ctx}/{quant}']}", flush=True)
                core.shutdown()
            result[f"ctx{ctx}/speedup"] = (result[f"ctx{ctx}/no_quant"]["tbt_ms"]
                                           / result[f"ctx{ctx}/int8"]["tbt_ms"])
    return result


def kernel(args) -> dict:
    from bladellm.kernels import kv_int8, resolve_kernels

    kernels = resolve_kernels("auto", "cpu")  # what a CPU worker runs by default
    result: dict = {"kernels": kernels.describe(), "batch": args.batch}
    g = torch.Generator().manual_seed(0)
    for ctx in (int(c) for c in args.contexts.split(",")):
        bs, blocks = 16, -(-ctx // 16)
        tables = torch.randperm(args.batch * blocks, generator=g).view(args.batch, blocks)
        kv = torch.randn(2, args.batch * blocks, bs, 4, 64, generator=g)
        caches = {"float32": (kv[0], kv[1]), "bfloat16": (kv[0].bfloat16(), kv[1].bfloat16()),
                  "int8": (kv_int8.pack(kv[0]), kv_int8.pack(kv[1]))}
        q = torch.randn(args.batch, 12, 64, generator=g)
        starts = torch.arange(args.batch + 1, dtype=torch.int32)
        lens = torch.full((args.batch,), ctx, dtype=torch.int32)
        runs = {}
        for name, (k, v) in caches.items():
            qq = q.bfloat16() if name == "bfloat16" else q
            out = torch.empty_like(qq)
            runs[name] = (out, qq, k, v)
        times: dict = {name: [] for name in runs}
        for rep in range(args.kernel_reps + 3):  # formats in turns; 3 warm-up rounds
            for name, (out, qq, k, v) in runs.items():
                start = time.perf_counter()
                kernels.paged_attention(out, qq, k, v, tables.int(), starts, lens, 0.125)
                if rep >= 3:
                    times[name].append(time.perf_counter() - start)
        for name in runs:
            result[f"ctx{ctx}/{name}_ms"] = statistics.median(times[name]) * 1e3
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--perplexity", action="store_true")
    ap.add_argument("--capacity", action="store_true")
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--kernel", action="store_true")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--kv_cache_memory", default="4MiB")
    ap.add_argument("--capacity_layers", type=int, default=2)
    ap.add_argument("--capacity_dtypes", default="float32,bfloat16")
    ap.add_argument("--capacity_requests", type=int, default=48)
    ap.add_argument("--capacity_prompt", type=int, default=96)
    ap.add_argument("--capacity_output", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--num_threads", type=int, default=None, help="engine threads (--decode)")
    ap.add_argument("--kernel_reps", type=int, default=30)
    ap.add_argument("--output_json")
    args = ap.parse_args()
    report = {"torch": torch.__version__, "threads": torch.get_num_threads(),
              "cpu": platform.processor() or platform.machine()}
    for name, fn in (("perplexity", perplexity), ("capacity", capacity), ("decode", decode),
                     ("kernel", kernel)):
        if getattr(args, name):
            report[name] = fn(args)
            print(json.dumps({name: report[name]}, indent=1), flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
