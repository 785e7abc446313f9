"""Decode steps with and without the compiled decoder stack, paired in one engine.

Runs the engine core in-process on a model of a real shape with random weights (``--shape``),
B requests decoding, and alternates two settings every 10 steps so that both see the same
machine (the host's memory bandwidth moves from minute to minute):

- ``--compare stack``: the compiled decoder stack (model/decoder_stack.py) vs the modules
  (what ``--enforce_eager`` runs);
- ``--compare layout``: fp32 weights packed in panels (``linear_panel``) or bf16 weights in
  pair panels (``linear_pairs``), what AVX2 machines run, vs in rows with a oneDNN copy (the
  GEMV kernel up to its row limit, oneDNN or F.linear above), each with its own decoder stack.

    python benchmarks/decoder_stack.py --shape llama-88m --batch 1 --compare stack
    python benchmarks/decoder_stack.py --shape smollm2-135m --batch 32 --compare layout
    python benchmarks/decoder_stack.py --shape smollm2-135m --batch 32 --compare layout \
        --dtype bfloat16

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
    from bladellm.model.loader import resolve_model

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
    ap.add_argument("--compare", choices=("stack", "layout"), default="stack")
    ap.add_argument("--rounds", type=int, default=10, help="pairs of 10-step blocks")
    args = ap.parse_args()

    from bladellm.engine.messages import EngineCoreRequest
    from bladellm.sampling_params import SamplingParams

    core = make_core(args.shape, args.dtype, args.batch)
    kernels = core.executor.worker.kernels  # the set the worker resolved and built with
    model = core.executor.worker.model_runner.model
    stack = model.model.compiled_stack
    if stack is None:
        raise SystemExit("the compiled decoder stack does not apply here (see the load log)")
    forms: dict[str, tuple] = {}
    if args.compare == "layout":
        from bladellm.kernels.compiled import LINEAR_MAX_ROWS_PANEL
        from bladellm.model.decoder_stack import CompiledDecoderStack

        packed = [m for m in model.modules() if hasattr(m, "packed_weight")]
        for name, limit in (("panels", LINEAR_MAX_ROWS_PANEL), ("rows", 0)):
            kernels.linear_max_rows_panel = kernels.linear_max_rows_pairs = limit
            packs = [kernels.pack_linear_weight(m.weight) for m in packed]
            for m, p in zip(packed, packs):
                m.packed_weight = p
            forms[name] = (limit, packs, CompiledDecoderStack.build(model.model, kernels))

    def setting(name: str) -> None:
        if args.compare == "stack":
            model.model.compiled_stack = stack if name == "stack" else None
        else:
            limit, packs, form_stack = forms[name]
            kernels.linear_max_rows_panel = kernels.linear_max_rows_pairs = limit
            for m, p in zip(packed, packs):
                m.packed_weight = p
            model.model.compiled_stack = form_stack

    names = ("stack", "modules") if args.compare == "stack" else ("panels", "rows")
    vocab = SHAPES[args.shape]["vocab_size"]
    params = SamplingParams(temperature=0.0, max_tokens=args.rounds * 20 + 64, ignore_eos=True)
    for i in range(args.batch):
        core.add_request(EngineCoreRequest(
            request_id=str(i), prompt_token_ids=[(7 * i + j) % (vocab - 20) + 10
                                                 for j in range(64)],
            sampling_params=params, arrival_time=time.time()))
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
