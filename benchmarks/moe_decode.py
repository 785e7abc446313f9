"""Mixture-of-experts decode: does a step cost the active parameters, not the total?

Three engines (in-process engine cores, random weights, ``--load_format dummy``) built from one
Qwen3-MoE shape (``--shape``):

- ``moe``: the model as configured (top-k of E experts per token);
- ``moe-all-experts``: the same shape with every expert selected (``num_experts_per_tok = E``):
  what a step costs when all experts' weights are read;
- ``dense-active``: a dense Qwen3 of the active size (MLP intermediate = top_k * expert size).

Batch-1 decode: median step time of each, the three alternating every 10 steps so that all see
the same machine (memory bandwidth on a shared host moves from minute to minute). Offline
throughput (``--throughput``): ``--batch`` requests of ``--prompt_len`` tokens generating
``--max_tokens`` each, end to end, output tokens per second.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/moe_decode.py --shape qwen3-moe-0.5b
    OMP_WAIT_POLICY=PASSIVE python benchmarks/moe_decode.py --throughput --batch 16
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

SHAPES = {
    # ~0.53B total, ~0.14B active: 64 experts of 384, top-8; Qwen3 attention.
    "qwen3-moe-0.5b": dict(hidden_size=1024, num_hidden_layers=6, num_attention_heads=16,
                           num_key_value_heads=4, head_dim=64, num_experts=64,
                           num_experts_per_tok=8, moe_intermediate_size=384,
                           intermediate_size=3072, vocab_size=32000),
}


def make_core(kind: str, shape: dict, dtype: str, batch: int):
    from transformers import Qwen3Config, Qwen3MoeConfig

    from bladellm.config import EngineConfig
    from bladellm.engine.engine_core import EngineCore
    from bladellm.model.loader import resolve_model

    common = {k: v for k, v in shape.items() if k not in (
        "num_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size")}
    common.update(max_position_embeddings=2048, tie_word_embeddings=False)
    if kind == "dense-active":
        cfg = Qwen3Config(**common, intermediate_size=shape["num_experts_per_tok"]
                          * shape["moe_intermediate_size"], architectures=["Qwen3ForCausalLM"])
    else:
        top_k = shape["num_experts"] if kind == "moe-all-experts" else \
            shape["num_experts_per_tok"]
        cfg = Qwen3MoeConfig(**common, num_experts=shape["num_experts"],
                             num_experts_per_tok=top_k, norm_topk_prob=True,
                             moe_intermediate_size=shape["moe_intermediate_size"],
                             intermediate_size=shape["intermediate_size"],
                             architectures=["Qwen3MoeForCausalLM"])
    with tempfile.TemporaryDirectory() as tmp:
        cfg.save_pretrained(tmp)
        config = EngineConfig.from_kwargs(model=tmp, load_format="dummy", dtype=dtype,
                                          max_num_seqs=max(batch, 1),
                                          max_num_batched_tokens=2048, kv_cache_memory="1GiB")
        return EngineCore(config, resolve_model(config.model))


def add_requests(core, n: int, prompt_len: int, max_tokens: int, vocab: int, tag: str) -> None:
    from bladellm.engine.messages import EngineCoreRequest
    from bladellm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(n):
        core.add_request(EngineCoreRequest(
            request_id=f"{tag}-{i}", prompt_token_ids=[(7 * i + j) % (vocab - 20) + 10
                                                       for j in range(prompt_len)],
            sampling_params=params, arrival_time=time.time()))


def params_of(core) -> tuple[float, float]:
    """(total, per-token active) parameters in millions: an expert counts top_k / E."""
    from bladellm.model.layers.fused_moe import moe_layers

    model = core.executor.worker.model_runner.model
    total = sum(p.numel() for p in model.parameters())
    inactive = sum((m.gate_up_proj.numel() + m.down_proj.numel())
                   * (1 - m.top_k / m.num_experts) for m in moe_layers(model))
    return total / 1e6, (total - inactive) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-moe-0.5b")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of 10 steps per engine")
    ap.add_argument("--throughput", action="store_true",
                    help="offline throughput instead of batch-1 step times")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt_len", type=int, default=128)
    ap.add_argument("--max_tokens", type=int, default=64)
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    kinds = ("moe", "moe-all-experts", "dense-active")
    batch = args.batch if args.throughput else 1
    cores = {k: make_core(k, shape, args.dtype, batch) for k in kinds}
    sizes = {k: params_of(c) for k, c in cores.items()}
    kernels = cores["moe"].executor.worker.kernels
    head = (f"{args.shape} {args.dtype} ({kernels.describe()}, {torch.get_num_threads()} "
            f"threads)")
    if args.throughput:
        for k, core in cores.items():
            add_requests(core, args.batch, args.prompt_len, args.max_tokens,
                         shape["vocab_size"], "warm")
            while core.scheduler.has_unfinished_requests():
                core.step()
        rates: dict[str, list[float]] = {k: [] for k in kinds}
        for r in range(2):
            for k, core in cores.items():
                add_requests(core, args.batch, args.prompt_len, args.max_tokens,
                             shape["vocab_size"], f"r{r}")
                start = time.perf_counter()
                while core.scheduler.has_unfinished_requests():
                    core.step()
                rates[k].append(args.batch * args.max_tokens / (time.perf_counter() - start))
        print(f"{head}: offline throughput, {args.batch} requests x {args.prompt_len} prompt "
              f"+ {args.max_tokens} output tokens (best of 2)")
        for k in kinds:
            total, active = sizes[k]
            print(f"  {k:16s} {total:7.1f}M total {active:7.1f}M active: "
                  f"{max(rates[k]):8.1f} output tok/s")
        return
    for k, core in cores.items():
        add_requests(core, 1, 16, args.rounds * 10 + 16, shape["vocab_size"], "decode")
        for _ in range(4):  # prefill and warm-up
            core.step()
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for k, core in cores.items():
            for _ in range(10):
                start = time.perf_counter()
                core.step()
                times[k].append((time.perf_counter() - start) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{head}: batch-1 decode, median step of {10 * args.rounds}")
    for k in kinds:
        total, active = sizes[k]
        print(f"  {k:16s} {total:7.1f}M total {active:7.1f}M active: {med[k]:7.2f} ms/step "
              f"({med[k] / med['dense-active']:.2f}x dense-active)")


if __name__ == "__main__":
    main()
