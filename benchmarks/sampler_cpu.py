"""CPU micro-benchmark of the Sampler: µs per call, before (a git revision) and now.

    python benchmarks/sampler_cpu.py
    python benchmarks/sampler_cpu.py --rows 64 --vocab 49152 --cases random top_p_top_k

"Before" is ``bladellm/sample/{ops,draw,sampler}.py`` at ``--before`` (default: the
exponential-race sampler), read with ``git show`` so the working tree is untouched. Logits are
synthetic but shaped like a language model's: N(0, 2) over the vocabulary plus a head of 40 tokens
3-12 above it, so that at temperature 0.8 the top token has ~0.5 of the mass and top-p 0.9 keeps 5
tokens (median) to a few hundred (``top_p_flat`` drops the head: top-p then keeps ~11% of the
vocabulary, the worst case of the candidate search).

The machine may be shared: the two samplers alternate call by call, each cell reports the median
of its repetitions (and the minimum, less sensitive to other load), after one warm-up call each.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

from bladellm.sample.metadata import SamplingMetadata
from bladellm.sample.sampler import Sampler
from bladellm.sampling_params import SamplingParams
from bladellm.worker.sampling_rows import SamplingRows

REPO = Path(__file__).resolve().parents[1]
DEFAULT_BEFORE = "79510a9"  # last revision with the exponential-race draw

CASES = {
    "greedy": dict(temperature=0.0),
    "random": dict(temperature=0.8),
    "top_p_top_k": dict(temperature=0.8, top_p=0.9, top_k=50),
    "top_p": dict(temperature=0.8, top_p=0.9),
    "top_p_flat": dict(temperature=0.8, top_p=0.9),
    "seeded_mix": dict(temperature=0.8),  # every other row seeded
    "penalties": dict(temperature=0.8, repetition_penalty=1.1, presence_penalty=0.3,
                      frequency_penalty=0.2),
    "logprobs": dict(temperature=0.8, logprobs=5),
}


def load_before(rev: str) -> type:
    """The ``Sampler`` class of revision ``rev``, with that revision's ops (and draw, if any)."""
    def source(path: str) -> str | None:
        done = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, capture_output=True,
                              text=True)
        return done.stdout if done.returncode == 0 else None

    old_sampler = types.ModuleType("sampler_before")
    code = source("bladellm/sample/sampler.py")
    if code is None:
        raise SystemExit(f"no bladellm/sample/sampler.py at revision {rev}")
    for name in ("ops", "draw"):  # draw.py: revisions after the draw left ops.py
        module_source = source(f"bladellm/sample/{name}.py")
        if module_source is not None:
            module = types.ModuleType(f"sampler_before_{name}")
            exec(compile(module_source, f"before/{name}.py", "exec"), module.__dict__)
            old_sampler.__dict__[name] = module
    code = re.sub(r"^from bladellm\.sample import [\w, ]+\n", "", code, flags=re.M)
    exec(compile(code, "before/sampler.py", "exec"), old_sampler.__dict__)
    return old_sampler.Sampler


def make_logits(rows: int, vocab: int, flat: bool, gen: torch.Generator) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=gen) * 2.0
    if not flat:
        head = torch.randint(0, vocab, (rows, 40), generator=gen)
        boost = 3.0 + 9.0 * torch.rand(rows, 40, generator=gen)
        logits.scatter_add_(1, head, boost)
    return logits


def make_metadata(case: str, rows: int, vocab: int, gen: torch.Generator) -> SamplingMetadata:
    params = [SamplingParams(**CASES[case]) for _ in range(rows)]
    generators = {}
    if case == "seeded_mix":
        params = [p.clone(seed=i) if i % 2 == 0 else p for i, p in enumerate(params)]
        generators = {i: torch.Generator().manual_seed(i) for i in range(0, rows, 2)}
    prompts = [torch.randint(0, vocab, (256,), generator=gen).tolist() for _ in range(rows)]
    outputs = [torch.randint(0, vocab, (64,), generator=gen).tolist() for _ in range(rows)]
    sampling = SamplingRows(rows, eos_token_ids=[0])
    for i, p in enumerate(params):
        sampling.set_row(i, p)
    token_ids = np.array([p + o for p, o in zip(prompts, outputs)], np.int64)
    md = sampling.metadata(np.arange(rows), token_ids, np.full(rows, 256 + 64),
                           np.full(rows, 256))
    md.generators = generators
    return md


def time_cell(samplers: list, logits: torch.Tensor, md: SamplingMetadata, reps: int,
              budget_s: float) -> list[list[float]]:
    times: list[list[float]] = [[] for _ in samplers]
    for sampler in samplers:
        sampler(logits, md)  # warm-up
    deadline = time.perf_counter() + budget_s
    while len(times[0]) < reps and (len(times[0]) < 3 or time.perf_counter() < deadline):
        for sampler, out in zip(samplers, times):
            start = time.perf_counter()
            sampler(logits, md)
            out.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default=DEFAULT_BEFORE, help="git revision to compare with")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--vocab", type=int, nargs="+", default=[8192, 49152, 128256])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--budget", type=float, default=2.0, help="seconds per cell, >= 3 reps")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    samplers = [load_before(args.before)(), Sampler()]
    print(f"torch {torch.__version__}, {args.threads} threads, before = {args.before}; "
          "µs per call, median (min) of alternating repetitions", flush=True)
    print(f"{'case':<12} {'R':>4} {'V':>7} {'before':>21} {'now':>19} {'speed-up':>9}")
    for vocab in args.vocab:
        for rows in args.rows:
            for case in args.cases:
                gen = torch.Generator().manual_seed(rows * 7919 + vocab)
                logits = make_logits(rows, vocab, case == "top_p_flat", gen)
                md = make_metadata(case, rows, vocab, gen)
                before, now = time_cell(samplers, logits, md, args.reps, args.budget)
                b, n = (statistics.median(t) * 1e6 for t in (before, now))
                print(f"{case:<12} {rows:>4} {vocab:>7} {b:>11.0f} ({min(before) * 1e6:>7.0f}) "
                      f"{n:>9.0f} ({min(now) * 1e6:>7.0f}) {b / n:>8.1f}x", flush=True)


if __name__ == "__main__":
    sys.exit(main())
