"""What tensor and pipeline parallelism cost or gain on this machine: world size 1 vs TP=T and
PP=P on the same model.

Measures, in one run:
- the all-reduce of one layer's output (``[M, hidden]``) between T gloo ranks (the collective
  every attention and MLP block ends with; a step makes 2 per layer);
- single-stream decode (one request, time per output token) and offline throughput (a batch of
  requests) through the offline ``LLM`` for each ``TxP`` configuration, same workload, greedy;
- memory: resident set of each worker process after load (world size > 1).

    python benchmarks/tensor_parallel.py --configs 1x1,2x1,1x2 --dtype float32

The model is the 88M Llama shape of offline_throughput.py (random weights, made once and cached).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import default_model_dir, make_model_dir, make_workload  # noqa: E402


def _allreduce_rank(rank: int, world: int, port: int, hidden: int, rows: list[int],
                    dtype: str, iters: int, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    result = {}
    for m in rows:
        x = torch.randn(m, hidden).to(getattr(torch, dtype))
        for _ in range(10):
            dist.all_reduce(x)
        times = []
        for _ in range(iters):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t)
        result[m] = statistics.median(times) * 1e6
    if rank == 0:
        out.update(result)
    dist.destroy_process_group()


def allreduce_latency(world: int, hidden: int, rows: list[int], dtype: str) -> dict[int, float]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = tmp.get_context("spawn").Manager()
    out = manager.dict()
    tmp.start_processes(_allreduce_rank, args=(world, port, hidden, rows, dtype, 200, out),
                        nprocs=world, start_method="spawn")
    return dict(out)


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_engine(model_dir: str, tp: int, pp: int, dtype: str, prompts, out_lens,
               threads: int) -> dict:
    from bladellm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=model_dir, dtype=dtype, tensor_parallel_size=tp, pipeline_parallel_size=pp,
              num_threads=threads, max_num_seqs=64, max_num_batched_tokens=2048,
              kv_cache_memory="1GiB")
    load_s = time.perf_counter() - t0
    try:
        greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                  for n in out_lens]
        llm.generate(prompts[:2], greedy[:2], use_tqdm=False)  # warm-up
        # Single stream: one request, 64 output tokens after a short prompt.
        one = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([prompts[0][:16]], [one], use_tqdm=False)
        per_token_ms = (time.perf_counter() - start) / 64 * 1e3
        start = time.perf_counter()
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        elapsed = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        rss = ([_rss_mib(p.pid) for p in llm.engine.core.executor.procs] if tp * pp > 1
               else [_rss_mib(os.getpid())])
        return {"tp": tp, "pp": pp, "load_s": round(load_s, 1), "single_stream_ms_per_token":
                round(per_token_ms, 2), "batch_tok_s": round(produced / elapsed, 1),
                "rss_mib_per_process": [round(r) for r in rss],
                "tokens": [o.outputs[0].token_ids for o in outs]}
    finally:
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="1x1,2x1,1x2",
                    help="comma-separated TxP (tensor x pipeline parallel) runs; the first is "
                         "the baseline of the ratios")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num_prompts", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None,
                    help="engine threads in total (default: one per usable CPU)")
    args = ap.parse_args()
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    model_dir = make_model_dir("llama-88m", default_model_dir("llama-88m"))
    prompts, out_lens = make_workload(args.num_prompts, (32, 128), (32, 64), 8192, seed=0)
    threads = args.threads or len(os.sched_getaffinity(0))
    max_tp = max(tp for tp, _ in configs)
    lat = allreduce_latency(max_tp, 768, [1, 8, 64, 512], args.dtype) if max_tp > 1 else {}
    runs = [run_engine(model_dir, tp, pp, args.dtype, prompts, out_lens, threads)
            for tp, pp in configs]
    tokens = [r.pop("tokens") for r in runs]
    base = runs[0]
    print(json.dumps({
        "machine": platform.processor() or platform.machine(), "cpus": threads,
        "torch": torch.__version__, "dtype": args.dtype,
        "allreduce_us_by_rows": {str(k): round(v, 1) for k, v in sorted(lat.items())},
        "runs": runs, "greedy_tokens_identical": all(t == tokens[0] for t in tokens),
        "throughput_vs_first": {f"{r['tp']}x{r['pp']}": round(
            r["batch_tok_s"] / base["batch_tok_s"], 2) for r in runs},
        "per_token_latency_vs_first": {f"{r['tp']}x{r['pp']}": round(
            r["single_stream_ms_per_token"] / base["single_stream_ms_per_token"], 2)
            for r in runs},
    }, indent=1))


if __name__ == "__main__":
    main()
