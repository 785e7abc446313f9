"""Host-side cost of one engine step: everything but the model's forward.

Runs the engine core in-process on a 1-layer model of the 88M shape (random weights) with B
requests decoding, and splits each step's wall time into the model forward (embedding, layers,
final norm and LM head) and the rest (scheduling, applying the scheduler's diffs, building the
flat batch, sampling metadata, sampling, output processing). The forward is timed by wrapping the
model's ``forward`` and ``compute_logits``.

    python benchmarks/step_overhead.py --batch_sizes 1,64 --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch


def make_config_dir(path: str, num_layers: int) -> str:
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=num_layers,
                      num_attention_heads=12, num_key_value_heads=4, vocab_size=8192,
                      max_position_embeddings=2048, torch_dtype="bfloat16",
                      architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(path)
    return path


def find_model(core) -> torch.nn.Module:
    """The model inside the engine core, wherever the runner lives."""
    for chain in (("runner",), ("executor", "worker", "model_runner"),
                  ("executor", "driver_worker", "model_runner")):
        obj = core
        try:
            for name in chain:
                obj = getattr(obj, name)
            return obj.model
        except AttributeError:
            continue
    raise RuntimeError("cannot find the model in the engine core")


def measure(batch: int, steps: int, dtype: str, num_layers: int) -> dict:
    from bladellm.config import EngineConfig
    from bladellm.engine.engine_core import EngineCore
    from bladellm.engine.messages import EngineCoreRequest
    from bladellm.model.loader import resolve_model
    from bladellm.sampling_params import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        config = EngineConfig.from_kwargs(
            model=make_config_dir(tmp, num_layers), load_format="dummy", dtype=dtype,
            max_num_seqs=max(batch, 1), max_num_batched_tokens=2048, kv_cache_memory="1GiB")
        core = EngineCore(config, resolve_model(config.model))
    model = find_model(core)
    forward_s = [0.0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            forward_s[0] += time.perf_counter() - start
            return out
        return wrapper

    model.forward = timed(model.forward)
    model.compute_logits = timed(model.compute_logits)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    for i in range(batch):
        core.add_request(EngineCoreRequest(
            request_id=str(i), prompt_token_ids=[(7 * i + j) % 8000 + 10 for j in range(32)],
            sampling_params=params, arrival_time=time.time()))
    for _ in range(8):  # prefill and warm-up
        core.step()
    totals, hosts = [], []
    for _ in range(steps):
        forward_s[0] = 0.0
        start = time.perf_counter()
        core.step()
        total = time.perf_counter() - start
        totals.append(total * 1e3)
        hosts.append((total - forward_s[0]) * 1e3)
    return {"batch": batch, "step_ms": statistics.median(totals),
            "host_ms": statistics.median(hosts), "forward_ms":
            statistics.median(totals) - statistics.median(hosts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch_sizes", default="1,64")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num_layers", type=int, default=1)
    ap.add_argument("--output_json")
    args = ap.parse_args()
    rows = [measure(int(b), args.steps, args.dtype, args.num_layers)
            for b in args.batch_sizes.split(",")]
    for r in rows:
        print(f"batch {r['batch']:4d}: step {r['step_ms']:.3f} ms, host (all but forward) "
              f"{r['host_ms']:.3f} ms, forward {r['forward_ms']:.3f} ms (medians)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
