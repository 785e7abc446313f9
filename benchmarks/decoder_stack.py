"""Decode steps with and without the compiled decoder stack, paired in one engine.

Runs the engine core in-process on a model of a real shape with random weights (``--shape``),
B requests decoding, and alternates two settings every 10 steps so that both see the same
machine (the host's memory bandwidth moves from minute to minute):

- ``--compare stack``: the compiled decoder stack (model/decoder_stack.py) vs the modules
  (what ``--enforce_eager`` runs);
- ``--compare row_limit``: the fp32 GEMV row limit on AVX2 raised to 24 (linears and the stack
  take up to 24 tokens) vs the current 16 (above it oneDNN and the modules).

    python benchmarks/decoder_stack.py --shape llama-88m --batch 1 --compare stack
    python benchmarks/decoder_stack.py --shape smollm2-135m --batch 20 --compare row_limit

Run it as the server runs the engine: ``OMP_WAIT_POLICY=PASSIVE``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

SHAPES = {
    "llama-88m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=4, vocab_size=8192),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         tie_word_embeddings=True),
}


def make_core(shape: str, dtype: str, batch: int):
    from transformers import LlamaConfig

    from bladellm.config import EngineConfig
    from bladellm.engine.engine_core import EngineCore
    from bladellm.model.checkpoint import resolve_model

    with tempfile.TemporaryDirectory() as tmp:
        LlamaConfig(**SHAPES[shape], max_position_embeddings=2048,
                    architectures=["LlamaForCausalLM"]).save_pretrained(tmp)
        config = EngineConfig.from_kwargs(model=tmp, load_format="dummy", dtype=dtype,
                                          max_num_seqs=batch, max_num_batched_tokens=2048,
                                          kv_cache_memory="1GiB")
        return EngineCore(config, resolve_model(config.model))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-88m")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--compare", choices=("stack", "row_limit"), default="stack")
    ap.add_argument("--rounds", type=int, default=10, help="pairs of 10-step blocks")
    args = ap.parse_args()

    from bladellm.engine.messages import EngineCoreRequest
    from bladellm.kernels import get_kernels
    from bladellm.sampling_params import SamplingParams

    kernels = get_kernels()
    dtype = getattr(torch, args.dtype)
    if args.compare == "row_limit":
        if kernels.isa != "avx2" or dtype != torch.float32:
            raise SystemExit("--compare row_limit is about fp32 on AVX2")
        # Built for 24 rows (its scratch), then switched between 24 and 16 below.
        kernels.linear_max_rows_packed[dtype] = kernels.linear_max_rows_narrow = 24
    core = make_core(args.shape, args.dtype, args.batch)
    model = core.executor.worker.model_runner.model
    stack = model.model.compiled_stack
    if stack is None:
        raise SystemExit("the compiled decoder stack does not apply here (see the load log)")

    def setting(name: str) -> None:
        if args.compare == "stack":
            model.model.compiled_stack = stack if name == "stack" else None
        else:
            limit = 24 if name == "24 rows" else 16
            kernels.linear_max_rows_packed[dtype] = kernels.linear_max_rows_narrow = limit
            stack.max_rows = limit

    names = ("stack", "modules") if args.compare == "stack" else ("24 rows", "16 rows")
    vocab = SHAPES[args.shape]["vocab_size"]
    params = SamplingParams(temperature=0.0, max_tokens=args.rounds * 20 + 64, ignore_eos=True)
    for i in range(args.batch):
        core.add_request(EngineCoreRequest(
            request_id=str(i), prompt_token_ids=[(7 * i + j) % (vocab - 20) + 10
                                                 for j in range(64)],
            sampling_params=params, eos_token_ids=[], arrival_time=time.time()))
    for _ in range(8):  # prefill and warm-up
        core.step()
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.rounds):
        for name in names:
            setting(name)
            for _ in range(10):
                start = time.perf_counter()
                core.step()
                times[name].append((time.perf_counter() - start) * 1e3)
    a, b = (statistics.median(times[n]) for n in names)
    print(f"{args.shape} {args.dtype} batch {args.batch} ({kernels.describe()}, "
          f"{torch.get_num_threads()} threads): {names[0]} {a:.2f} ms, {names[1]} {b:.2f} ms "
          f"per step (medians of {10 * args.rounds}); {names[1]} / {names[0]} = {b / a:.2f}x")


if __name__ == "__main__":
    main()
