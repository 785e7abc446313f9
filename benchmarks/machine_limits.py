"""The machine's own limits for a CPU decode step: memory bandwidth and GEMM peak.

A batch-1 decode step reads every weight once, so its floor is (weight bytes ÷ memory
bandwidth); a large batch is bound by the cores' multiply-add rate. This script measures both
with the threads the engine would use, and prints the floor for a model's shapes:

- read bandwidth: ``torch.sum`` over a buffer far larger than the caches (the way a GEMV streams
  its weight), median of the repeats;
- copy bandwidth: ``Tensor.copy_`` between two such buffers (bytes read + written);
- GEMM peak: ``F.linear`` (oneDNN) at a cache-resident large shape, bf16 and fp32, GFLOP/s;
- the decode floor: the model's linear weights (from its config.json, LM head included) in the
  given dtype ÷ the read bandwidth;
- with ``--decode``: bladellm's own batch-1 decode (one request, a 16-token prompt, greedy,
  ``--decode_tokens`` tokens, offline ``LLM``), ms per token, and its ratio to the floor. The
  bandwidth is measured again right after it (the host's bandwidth drifts) and the ratio uses
  the mean of the two readings.

    python benchmarks/machine_limits.py --model_dir /tmp/smollm2-hf --dtype bfloat16 --decode
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: first touch of the pages, oneDNN's primitive cache
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_bandwidth(num_bytes: int, repeats: int) -> float:
    buf = torch.ones(num_bytes // 4, dtype=torch.float32)
    return num_bytes / _median_seconds(lambda: buf.sum(), repeats) / 1e9


def copy_bandwidth(num_bytes: int, repeats: int) -> float:
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * num_bytes / _median_seconds(lambda: dst.copy_(src), repeats) / 1e9


def gemm_gflops(dtype: torch.dtype, m: int, k: int, n: int, repeats: int) -> float:
    x = torch.randn(m, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    return 2 * m * k * n / _median_seconds(lambda: F.linear(x, w), repeats) / 1e9


def linear_weight_params(config: dict) -> int:
    """Parameters a Llama-family decode step streams: attention and MLP projections of every
    layer and the LM head (tied or not, it is read once per step)."""
    h = config["hidden_size"]
    inter = config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or h // heads
    per_layer = (h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h
                 + 3 * h * inter)
    return config["num_hidden_layers"] * per_layer + config["vocab_size"] * h


def bladellm_decode_ms(model_dir: str, dtype: str, num_tokens: int) -> float:
    from bladellm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=dtype, max_num_seqs=1, kv_cache_memory="1GiB")
    prompt = {"prompt_token_ids": list(range(1, 17))}
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)  # warm-up
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    first = _median_seconds(lambda: llm.generate([prompt], params, use_tqdm=False), 3)
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens + 1, ignore_eos=True)
    full = _median_seconds(lambda: llm.generate([prompt], params, use_tqdm=False), 3)
    return (full - first) / num_tokens * 1e3  # the prefill and set-up cancel out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model_dir", help="a config.json to compute the batch-1 decode floor for")
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    ap.add_argument("--buffer_mib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--decode", action="store_true",
                    help="also time bladellm's batch-1 decode on --model_dir")
    ap.add_argument("--decode_tokens", type=int, default=64)
    ap.add_argument("--output_json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    num_bytes = args.buffer_mib << 20
    result: dict = {"threads": args.threads}
    result["read_gb_s"] = read_bandwidth(num_bytes, args.repeats)
    result["copy_gb_s"] = copy_bandwidth(num_bytes, args.repeats)
    for name, dtype in _DTYPES.items():
        result[f"gemm_{name}_gflops"] = gemm_gflops(dtype, 1024, 2048, 2048, args.repeats)
    if args.model_dir:
        with open(f"{args.model_dir}/config.json") as f:
            config = json.load(f)
        params = linear_weight_params(config)
        weight_bytes = params * _DTYPES[args.dtype].itemsize
        result.update(weight_params=params, weight_bytes=weight_bytes,
                      decode_floor_ms=weight_bytes / (result["read_gb_s"] * 1e9) * 1e3)
        if args.decode:
            result["bladellm_decode_ms"] = bladellm_decode_ms(args.model_dir, args.dtype,
                                                              args.decode_tokens)
            result["read_gb_s_after"] = read_bandwidth(num_bytes, args.repeats)
            mean_bw = (result["read_gb_s"] + result["read_gb_s_after"]) / 2
            result["decode_floor_mean_ms"] = weight_bytes / (mean_bw * 1e9) * 1e3
            result["decode_over_floor"] = (result["bladellm_decode_ms"]
                                           / result["decode_floor_mean_ms"])
    for key, value in result.items():
        print(f"{key:>22}: {value:.2f}" if isinstance(value, float) else f"{key:>22}: {value}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
