"""First timing of a Llama-3.1-8B-shaped model with random weights on one GPU.

Parts (``--part``), each its own process so that one's memory never weighs on the next:

- ``bandwidth``: the device's copy bandwidth, a large device-to-device copy timed with events
  (bytes read + written per second; median of 20 after warm-up);
- ``decode1``: bladellm at batch 1 (``--load_format dummy``, bf16): the median decode-step time of
  one request after its prefill, as tok/s, beside the HBM roofline = copy bandwidth / bytes one
  decode step must read (every weight once but the input embedding, of which it reads a row,
  + the KV cache of the context so far);
- ``batch``: bladellm, ``--batch`` requests of ``--prompt_len`` random tokens each producing
  ``--output_len`` tokens (ignore_eos), all submitted at once: output tok/s over the whole run
  (prefill included), plus TTFT of the batch;
- ``hf``: transformers' ``generate`` on the same workload (greedy, dynamic cache), same device;
- ``steps``: ``decode1`` then ``batch`` on one engine (``--max_num_seqs`` = ``--batch``), so
  that a second set of both costs one start-up: ``gpu_session.sh`` runs it with
  ``--disable_cuda_graph`` beside the ``decode1`` and ``batch`` parts, which replay CUDA graphs.

bladellm parts replay CUDA graphs for decode steps (the default, docs/gpu.md) unless
``--disable_cuda_graph``; each row says which (``cuda_graph``), and ``batch`` rows carry the
median decode-step time once every request is decoding (``decode_step_ms``), the number the
graphs change.

Each part prints one line and appends a JSON row to ``--out``.

    python benchmarks/gpu_llama8b.py --part bandwidth --out gpu-out/llama8b.jsonl
    python benchmarks/gpu_llama8b.py --part decode1 --bandwidth_gbs 3000 --out ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

LLAMA_31_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                   max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192},
                   tie_word_embeddings=False)


def model_config(num_layers: int | None, hidden: int | None):
    from transformers import LlamaConfig

    kw = dict(LLAMA_31_8B)
    if num_layers:
        kw["num_hidden_layers"] = num_layers
    if hidden:  # a small stand-in for trying the script on a CPU
        kw.update(hidden_size=hidden, intermediate_size=hidden * 3, vocab_size=4096,
                  num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256))
    return LlamaConfig(**kw, torch_dtype="bfloat16", architectures=["LlamaForCausalLM"])


def bandwidth(device: str) -> dict:
    n = 1 << 30  # 1 GiB each way: far past L2
    src = torch.randn(n // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(25):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            ms = (time.perf_counter() - t0) * 1e3
        if i >= 5:
            times.append(ms)
    ms = statistics.median(times)
    return {"part": "bandwidth", "copy_GBps": 2 * n / (ms / 1e3) / 1e9, "copy_ms": ms}


def engine(tmp: str, args, max_num_seqs: int):
    from bladellm.config import EngineConfig
    from bladellm.engine.engine_core import EngineCore
    from bladellm.model.loader import resolve_model

    model_config(args.num_layers, args.hidden).save_pretrained(tmp)
    max_len = args.prompt_len + args.output_len + 16
    config = EngineConfig.from_kwargs(
        model=tmp, load_format="dummy", dtype="bfloat16", device=args.device,
        max_model_len=max_len, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(8192, args.prompt_len),
        # On a CPU trial: every layer eagerly, as before graphs existed (no compiled stack).
        enforce_eager=args.device == "cpu", disable_cuda_graph=args.disable_cuda_graph,
        **({"kv_cache_memory": "2GiB"} if args.device == "cpu" else {}))
    return EngineCore(config, resolve_model(config.model, device=args.device))


def weight_and_kv_bytes(core) -> tuple[int, int, int]:
    """(weight bytes, weight bytes a decode step reads, KV-cache bytes per token) of the engine
    core's model. A step reads every weight once except the input embedding, of which it reads
    one row per token (unless it is tied to the LM head, which reads it whole)."""
    from bladellm.platforms.cpu_defaults import model_weight_bytes

    runner = core.executor.worker.model_runner
    weights = model_weight_bytes(runner.model)
    embed = getattr(getattr(runner.model, "model", None), "embed_tokens", None)
    embed_w = getattr(embed, "weight", None)
    head_w = getattr(getattr(runner.model, "lm_head", None), "weight", None)
    read = weights
    if embed_w is not None and head_w is not embed_w:
        read -= embed_w.numel() * embed_w.element_size()
    return weights, read, runner.bytes_per_block // runner.block_size


def requests(n: int, prompt_len: int, output_len: int, vocab: int):
    from bladellm.engine.messages import EngineCoreRequest
    from bladellm.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    return [EngineCoreRequest(request_id=str(i), sampling_params=params, arrival_time=time.time(),
                              prompt_token_ids=torch.randint(10, vocab, (prompt_len,),
                                                             generator=g).tolist())
            for i in range(n)]


def graphs_row(core) -> dict:
    """Whether the engine's decode steps replayed CUDA graphs, and how many steps did."""
    graphs = core.executor.worker.model_runner.graphs
    if graphs is None:
        return {"cuda_graph": "off"}
    return {"cuda_graph": "on", "graph_steps": sum(graphs.num_steps.values()),
            "graph_sizes": len(graphs.graphs)}


def decode1(args, core=None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        core = core or engine(tmp, args, max_num_seqs=1)
        vocab = model_config(args.num_layers, args.hidden).vocab_size
        for warm in (True, False):
            (req,) = requests(1, args.prompt_len, args.output_len, vocab)
            req.request_id = f"{warm}"
            core.add_request(req)
            core.step()  # prefill
            times = []
            while core.has_unfinished_requests():
                t0 = time.perf_counter()
                core.step()  # returns after the sampled id reached the host
                times.append(time.perf_counter() - t0)
        weights, read_weights, kv_per_token = weight_and_kv_bytes(core)
        graphs = graphs_row(core)
    step_s = statistics.median(times[1:-1] or times)
    # Bytes one decode step must read: every weight once but the input embedding (a row of
    # it), and the KV of the mean context.
    context = args.prompt_len + args.output_len / 2
    per_token = read_weights + kv_per_token * context
    row = {"part": "decode1", "tok_s": 1 / step_s, "step_ms": step_s * 1e3,
           "weight_GB": weights / 1e9, "read_weight_GB": read_weights / 1e9,
           "bytes_per_token_GB": per_token / 1e9,
           "prompt_len": args.prompt_len, "output_len": args.output_len, **graphs}
    if args.bandwidth_gbs:
        roof = args.bandwidth_gbs * 1e9 / per_token
        row.update(roofline_tok_s=roof, fraction_of_roofline=row["tok_s"] / roof)
    return row


def batch(args, core=None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        core = core or engine(tmp, args, max_num_seqs=args.batch)
        vocab = model_config(args.num_layers, args.hidden).vocab_size
        for r in requests(2, 16, 4, vocab):  # warm-up (compilation, allocator)
            r.request_id = "warm" + r.request_id
            core.add_request(r)
        while core.has_unfinished_requests():
            core.step()
        reqs = requests(args.batch, args.prompt_len, args.output_len, vocab)
        start = time.perf_counter()
        for r in reqs:
            core.add_request(r)
        first = {}
        produced = 0
        decode_steps = []  # seconds of steps taken once every request had its first token
        while core.has_unfinished_requests():
            t0 = time.perf_counter()
            all_decoding = len(first) == len(reqs)
            out = core.step()
            now = time.perf_counter() - start
            if all_decoding:
                decode_steps.append(time.perf_counter() - t0)
            for o in getattr(out, "outputs", []) or []:
                produced += len(o.new_token_ids)
                first.setdefault(o.request_id, now)
        elapsed = time.perf_counter() - start
        graphs = graphs_row(core)
    return {"part": "batch", "engine": "bladellm", "batch": args.batch,
            "prompt_len": args.prompt_len, "output_len": args.output_len,
            "output_tokens": produced, "output_tok_s": produced / elapsed, "elapsed_s": elapsed,
            "ttft_median_s": statistics.median(first.values()) if first else None,
            "decode_step_ms": (statistics.median(decode_steps) * 1e3 if decode_steps
                               else None), **graphs}


def steps(args) -> list[dict]:
    """``decode1`` and ``batch`` on one engine (one start-up)."""
    with tempfile.TemporaryDirectory() as tmp:
        core = engine(tmp, args, max_num_seqs=args.batch)
        one = decode1(args, core)
        return [one, batch(args, core)]


@torch.no_grad()
def hf(args) -> dict:
    import transformers

    cfg = model_config(args.num_layers, args.hidden)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, cfg.vocab_size, (args.batch, args.prompt_len), generator=g)
    ids = ids.to(args.device)
    kw = dict(do_sample=False, pad_token_id=0)
    model.generate(ids[:2, :16], max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                         **kw)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    produced = (out.shape[1] - args.prompt_len) * args.batch
    return {"part": "hf", "engine": "transformers " + transformers.__version__,
            "batch": args.batch, "prompt_len": args.prompt_len, "output_len": args.output_len,
            "output_tokens": produced, "output_tok_s": produced / elapsed, "elapsed_s": elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("bandwidth", "decode1", "batch", "hf", "steps"),
                    required=True)
    ap.add_argument("--disable_cuda_graph", action="store_true",
                    help="bladellm parts: every step eagerly (the engine flag)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt_len", type=int, default=1024)
    ap.add_argument("--output_len", type=int, default=128)
    ap.add_argument("--bandwidth_gbs", type=float, default=None,
                    help="measured copy bandwidth (GB/s) for the roofline")
    ap.add_argument("--num_layers", type=int, default=None, help="fewer layers (trials)")
    ap.add_argument("--hidden", type=int, default=None, help="a small stand-in shape (trials)")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = {"bandwidth": lambda: bandwidth(args.device), "decode1": lambda: decode1(args),
            "batch": lambda: batch(args), "hf": lambda: hf(args),
            "steps": lambda: steps(args)}[args.part]()
    for row in rows if isinstance(rows, list) else [rows]:
        row["device"] = (torch.cuda.get_device_name() if args.device.startswith("cuda")
                         else args.device)
        print("llama8b " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                    for k, v in row.items()), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
