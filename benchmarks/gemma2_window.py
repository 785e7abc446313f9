"""Gemma 2 long-context decode: the sliding window's saving in step time and KV memory.

A Gemma-2-2B-shaped model (hidden 2304, 8 query / 4 KV heads of 256, intermediate 9216, soft
caps, query_pre_attn_scalar 256) with random weights (``--load_format dummy``), cut to
``--layers`` layers and a 32k vocabulary so that it runs on a small CPU machine; the window is
``--window`` tokens (the real model's is 4096). One request (or ``--batch``) decodes at a
context of 4x the window; four engines step in turns, so that a busy neighbour slows all
alike:

- ``gemma2``: Gemma 2's alternating local / global layers, windows honoured by the kernels
  (local layers read ``window`` keys per query), hybrid KV cache groups (core/kv_groups.py):
  the local layers' group frees the blocks that left the window, the global group keeps all;
- ``gemma2_all_kept``: the same model with ``--disable_hybrid_kv_cache``: one block table,
  every block kept for every layer (the KV manager before the groups);
- ``no_window``: every layer global (what an engine without sliding-window attention runs);
- ``all_local``: every layer local: the KV manager frees the blocks that left the window.

Reports the median step time and the KV the requests hold (block ids x the bytes of one:
with groups a block id holds the KV of one layer of each group's run, half the layers here).

    python benchmarks/gemma2_window.py --window 512 --layers 4 --steps 24
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time

LAYOUTS = ("gemma2", "gemma2_all_kept", "no_window", "all_local")


def _model_dir(path: str, layout: str, args) -> str:
    from transformers import Gemma2Config

    types = {"gemma2": ["sliding_attention", "full_attention"] * (args.layers // 2),
             "gemma2_all_kept": ["sliding_attention", "full_attention"] * (args.layers // 2),
             "no_window": ["full_attention"] * args.layers,
             "all_local": ["sliding_attention"] * args.layers}[layout]
    Gemma2Config(hidden_size=2304, intermediate_size=9216, num_hidden_layers=args.layers,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                 query_pre_attn_scalar=256, sliding_window=args.window, layer_types=types,
                 attn_logit_softcapping=50.0, final_logit_softcapping=30.0, vocab_size=32768,
                 max_position_embeddings=8 * args.window, architectures=["Gemma2ForCausalLM"]
                 ).save_pretrained(path)
    return path


def _core(model_dir: str, layout: str, args):
    from bladellm.config import EngineConfig
    from bladellm.engine.engine_core import EngineCore
    from bladellm.model.loader import resolve_model

    config = EngineConfig.from_kwargs(
        model=model_dir, load_format="dummy", dtype="float32", kv_cache_memory=args.kv_memory,
        max_num_seqs=args.batch, max_num_batched_tokens=1024, num_threads=args.num_threads,
        max_model_len=4 * args.window + args.steps + 32,
        disable_hybrid_kv_cache=layout == "gemma2_all_kept")
    return EngineCore(config, resolve_model(config.model))


def _add(core, req_id: str, prompt: list[int], max_tokens: int) -> None:
    from bladellm.engine.messages import EngineCoreRequest
    from bladellm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    core.add_request(EngineCoreRequest(request_id=req_id, prompt_token_ids=prompt,
                                       sampling_params=params, arrival_time=time.time()))


def _held_bytes(core) -> tuple[int, int]:
    """(block ids the requests hold in every group's table, their bytes)."""
    blocks = core.scheduler.kv_cache_manager.num_held_blocks()
    return blocks, blocks * core.executor.worker.model_runner.bytes_per_block


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--num_threads", default=None)
    p.add_argument("--kv_memory", default="2GiB")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    ctx = 4 * args.window
    result: dict = {"window": args.window, "context": ctx, "layers": args.layers,
                    "batch": args.batch, "machine": platform.processor() or platform.machine()}
    cores = {}
    with tempfile.TemporaryDirectory() as tmp:
        for layout in LAYOUTS:
            core = cores[layout] = _core(_model_dir(f"{tmp}/{layout}", layout, args), layout,
                                         args)
            for i in range(args.batch):  # distinct prompts: no prompt-cache sharing
                _add(core, str(i), [(7 * j + 13 * i) % 30000 + 10 for j in range(ctx)],
                     args.steps + 16)
            start = time.perf_counter()
            while any(r.num_computed_tokens < ctx for r in core.scheduler.requests.values()):
                core.step()
            print(f"{layout}: prefill {time.perf_counter() - start:.1f} s", flush=True)
            for _ in range(3):
                core.step()
        times: dict = {layout: [] for layout in LAYOUTS}
        for _ in range(args.steps):
            for layout, core in cores.items():
                start = time.perf_counter()
                core.step()
                times[layout].append(time.perf_counter() - start)
        for layout, core in cores.items():
            blocks, held = _held_bytes(core)
            result[layout] = {"step_ms": statistics.median(times[layout]) * 1e3,
                              "kv_blocks_held": blocks,
                              "kv_mib_held": held / 2 ** 20,
                              "kv_group_windows": core.scheduler.kv_cache_manager.group_windows}
            print(f"{layout}: {result[layout]}", flush=True)
            core.shutdown()
    base = result["no_window"]
    for layout in ("gemma2", "gemma2_all_kept", "all_local"):
        result[f"{layout}/step_speedup"] = base["step_ms"] / result[layout]["step_ms"]
        result[f"{layout}/kv_fraction"] = result[layout]["kv_mib_held"] / base["kv_mib_held"]
    kept = result["gemma2_all_kept"]
    result["gemma2/groups_vs_all_kept"] = {
        "kv_fraction": result["gemma2"]["kv_mib_held"] / kept["kv_mib_held"],
        "step_speedup": kept["step_ms"] / result["gemma2"]["step_ms"]}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
