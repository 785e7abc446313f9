"""Multi-LoRA serving cost: the demo model with N rank-R adapters on every projection, requests
spread uniformly over them, against the base model alone, in one server run (interleaved).

    flock /tmp/bladellm-bench.lock python benchmarks/lora_serving.py --concurrency 1,32

Prints a JSON report: per concurrency, output tok/s and mean TBT (inter-token gap) for the base
model and for the adapters, and their ratio; plus the cost of a cold adapter load (disk → host →
device) as the extra TTFT of a request for an adapter never used before, and the bare disk →
host load time measured in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

WORDS = ("time people year way day thing man world life hand part child eye woman place work "
         "week case point number group problem fact system program question government").split()


def write_adapters(hf_config, root: str, num: int, rank: int) -> list[str]:
    """Random PEFT-format adapters on q/k/v/o/gate/up/down of every layer."""
    from safetensors.torch import save_file

    from bladellm.lora.adapter import BaseShapes

    base = BaseShapes.from_hf_config(hf_config)
    paths = []
    for n in range(num):
        path = os.path.join(root, f"a{n}")
        os.makedirs(path)
        gen = torch.Generator().manual_seed(n)
        tensors = {}
        for layer in range(base.num_layers):
            for name, (fan_in, fan_out) in base.sizes.items():
                part = "self_attn" if name[0] in "qkvo" else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.02
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                       "target_modules": list(base.sizes)}, f)
        paths.append(path)
    return paths


def start_server(args, root: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "bladellm.entrypoints.cli.server", "--model", args.model,
           "--host", "127.0.0.1", "--port", "0", "--disable_access_log", "--enable_lora",
           "--max_loras", str(args.num_adapters), "--max_cpu_loras", str(args.num_adapters),
           "--max_lora_rank", str(args.rank), "--lora_root", root,
           "--max_num_seqs", str(max(args.concurrency))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url: list[str] = []
    ready = threading.Event()

    def drain() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            if args.verbose:
                sys.stderr.write(line)
            m = re.search(r"ready at (http://[\d.]+:\d+)", line)
            if m and not url:
                url.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    if not ready.wait(600) or not url:
        proc.kill()
        raise SystemExit("server did not start")
    return proc, url[0]


def prompt(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


async def run_batch(url: str, models: list[str], concurrency: int, num: int, args,
                    seed: int) -> dict:
    import aiohttp

    from bladellm.bench.client import RequestOptions, send_request
    from bladellm.bench.datasets import BenchRequest

    rng = random.Random(seed)
    reqs = [BenchRequest(prompt(rng, args.input_len), args.input_len, args.output_len)
            for _ in range(num)]
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async def one(i: int):
            opts = RequestOptions(model=models[i % len(models)], ignore_eos=True)
            async with sem:
                return await send_request(session, url, reqs[i], opts)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(num)))
        wall = time.perf_counter() - start
    failed = [r.error for r in results if not r.success]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed: {failed[0]}")
    gaps = [g for r in results for g in r.itl]
    return {"output_tok_s": sum(r.output_tokens for r in results) / wall,
            "mean_tbt_ms": 1000 * statistics.mean(gaps),
            "mean_ttft_ms": 1000 * statistics.mean(r.ttft for r in results)}


async def cold_load(url: str, adapters: list[str], args) -> dict:
    """TTFT of the first request for each adapter (cold: disk → host → device) and of a second
    one (warm), one request at a time, with different prompts (no prompt-cache hit)."""
    cold, warm = [], []
    for i, path in enumerate(adapters):
        c = await run_batch(url, [path], 1, 1, args, seed=1000 + i)
        w = await run_batch(url, [path], 1, 1, args, seed=2000 + i)
        cold.append(c["mean_ttft_ms"])
        warm.append(w["mean_ttft_ms"])
    return {"cold_ttft_ms": statistics.mean(cold), "warm_ttft_ms": statistics.mean(warm),
            "cold_load_extra_ms": statistics.mean(cold) - statistics.mean(warm)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--num_adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--concurrency", default="1,32")
    p.add_argument("--requests_per_slot", type=int, default=3,
                   help="requests per run = concurrency x this (at least 8)")
    p.add_argument("--input_len", type=int, default=64, help="prompt words (~tokens)")
    p.add_argument("--output_len", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2, help="base/LoRA runs interleaved")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]

    from bladellm.config import ModelConfig
    from bladellm.lora.adapter import BaseShapes, load_adapter
    from bladellm.model.loader import resolve_model

    resolved = resolve_model(ModelConfig(model=args.model))
    with tempfile.TemporaryDirectory() as root:
        adapters = write_adapters(resolved.hf_config, root, args.num_adapters, args.rank)
        start = time.perf_counter()
        w = load_adapter(adapters[0], args.rank, BaseShapes.from_hf_config(resolved.hf_config),
                         resolved.dtype)
        disk_ms = 1000 * (time.perf_counter() - start)
        proc, url = start_server(args, root)
        try:
            report = {"model": args.model, "dtype": str(resolved.dtype),
                      "adapters": args.num_adapters, "rank": args.rank,
                      "adapter_mib": w.num_bytes / (1 << 20), "disk_to_host_load_ms": disk_ms,
                      "torch": torch.__version__, "python": sys.version.split()[0]}
            import httpx

            base_name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            asyncio.run(run_batch(url, [base_name], 2, 4, args, seed=7))  # warm-up
            report["cold_load"] = asyncio.run(cold_load(url, adapters, args))
            runs: dict = {}
            for rnd in range(args.rounds):
                for c in args.concurrency:
                    num = max(8, c * args.requests_per_slot)
                    for mode, models in (("base", [base_name]), ("lora", adapters)):
                        res = asyncio.run(run_batch(url, models, c, num, args,
                                                    seed=rnd * 100 + c))
                        runs.setdefault(c, {}).setdefault(mode, []).append(res)
                        print(f"round {rnd} c={c} {mode}: {res}", file=sys.stderr)
            report["by_concurrency"] = {}
            for c, modes in runs.items():
                agg = {m: {k: statistics.mean(r[k] for r in rs) for k in rs[0]}
                       for m, rs in modes.items()}
                agg["lora_over_base_tok_s"] = (agg["lora"]["output_tok_s"]
                                               / agg["base"]["output_tok_s"])
                agg["lora_over_base_tbt"] = agg["lora"]["mean_tbt_ms"] / agg["base"]["mean_tbt_ms"]
                report["by_concurrency"][c] = agg
            print(json.dumps(report, indent=2))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
