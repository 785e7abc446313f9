"""Host-side cost that structured output adds to one engine step, per component, at a given
number of constrained rows: the batched bitmask fill (llguidance, in the background thread), the
mask applied to the logits (plus the copy of the logits it needs), and advancing the matchers
with the sampled tokens. Matchers are advanced along real answers first so that they sit in
the middle of a JSON document, as during decoding. Compare the sum with the step time of the
same model (benchmarks/structured_output.py reports TPOT).

    python benchmarks/structured_output_step.py --rows 1 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bladellm.config import ModelConfig  # noqa: E402
from bladellm.engine.model_info import model_info_for  # noqa: E402
from bladellm.guided.backend import LLGuidanceBackend  # noqa: E402
from bladellm.guided.bitmask import apply_token_bitmask  # noqa: E402
from bladellm.guided.manager import GuidedDecodingManager  # noqa: E402
from bladellm.kernels import resolve_kernels  # noqa: E402
from bladellm.model.loader import resolve_model  # noqa: E402
from bladellm.sampling_params import GuidedDecodingParams  # noqa: E402

ANSWER = {"employee_id": "E123456", "name": "Alice Chen", "age": 34,
          "email": "alice.chen@example.com", "department": "engineering",
          "title": "Senior Engineer", "is_manager": False, "salary": 120000,
          "skills": ["python", "rust", "distributed systems"],
          "address": {"city": "Hangzhou", "country": "China", "zip": "310000"},
          "projects": [{"name": "BladeLLM", "year": 2024}]}


def timed(fn, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--schema", default=os.path.join(HERE, "schemas", "employee_profile.json"))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args()
    info = model_info_for(resolve_model(ModelConfig(model=args.model)))
    vocab = info.vocab_size
    backend = LLGuidanceBackend(info.tokenizer, vocab, info.eos_token_ids)
    with open(args.schema) as f:
        params = GuidedDecodingParams(json=json.load(f))
    text = json.dumps(ANSWER, separators=(", ", ": "))
    tokens = info.tokenizer.encode(text, add_special_tokens=False)
    manager = GuidedDecodingManager(lambda: backend, vocab, max(args.rows), 8, 10.0)
    for rows in args.rows:
        states = []
        for i in range(rows):  # spread over the document: keys, strings, numbers, arrays
            state = manager.grammar_for(params)
            state.future.result()
            state.is_ready()
            stop = 1 + (i * 7919) % (len(tokens) - 2)
            assert state.accept_tokens(tokens[:stop]) == stop
            states.append((state, tokens[stop]))
        entries = [(str(i), s, []) for i, (s, _) in enumerate(states)]
        logits = torch.randn(rows, vocab)
        row_ids = torch.arange(rows)
        bitmask = manager.start_bitmask(entries).result().copy()
        fill = timed(lambda: manager.start_bitmask(entries).result(), args.repeat)
        # In place, as the model runner lets the sampler do (no logits copy since round 3).
        kernels = resolve_kernels("auto", "cpu")  # what a CPU worker runs by default
        apply = timed(lambda: apply_token_bitmask(logits, row_ids, bitmask, kernels),
                      args.repeat)
        clone = timed(lambda: logits.clone(), args.repeat)

        def accept() -> None:
            for state, tok in states:
                state.accept_tokens([tok])
                state.is_terminated()
            for state, _ in states:
                state.rollback(1)

        adv = timed(accept, args.repeat)
        print(json.dumps({"rows": rows, "vocab": vocab, "fill_bitmask_ms": round(fill, 3),
                          "apply_mask_ms": round(apply, 3),
                          "logits_copy_ms": round(clone, 3),
                          "accept_and_rollback_ms": round(adv, 3),
                          "serial_total_ms": round(fill + apply + adv / 2, 3)}), flush=True)


if __name__ == "__main__":
    main()
