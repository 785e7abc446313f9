"""bf16 paged attention of the compiled kernels at the demo model's shapes, µs per call.

SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64, KV block 16.

Cases: 32 decodes at context 200 (row_step, G = 3), one 256-token prefill chunk and eight
128-token chunks with no cached context (lanes_step), one decode at context 2048 (key
partitions when threads > 1), and speculative verifications of 2, 3 and 5 tokens (6, 9 and 15
rows per kv head: either side of the rows / lanes threshold). Each number is the median over
``--reps`` calls after warm-up; ``--clock cpu`` (the default, with ``--threads 1``) times the
calling thread's CPU time, which a neighbour on a shared machine does not inflate.

To compare two trees, run the script under each one's PYTHONPATH, alternately:

    PYTHONPATH=/work/main python benchmarks/attention_bf16.py
    PYTHONPATH=$PWD python benchmarks/attention_bf16.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "kernels"))
from kernel_cases import make_batch  # noqa: E402

from bladellm.kernels import load_kernels  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16

# name: (query lengths, sequence lengths)
CASES = {
    "decode 32 x ctx 200": ([1] * 32, [200] * 32),
    "prefill 1 x 256": ([256], [256]),
    "prefill 8 x 128": ([128] * 8, [128] * 8),
    "decode 1 x ctx 2048": ([1], [2048]),
    "verify 32 x 2 @ 200": ([2] * 32, [200] * 32),
    "verify 32 x 3 @ 200": ([3] * 32, [200] * 32),
    "verify 32 x 5 @ 200": ([5] * 32, [200] * 32),
}


def time_case(kernels, q_lens: list[int], seq_lens: list[int], reps: int, clock) -> float:
    batch = make_batch(q_lens, seq_lens, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                       torch.bfloat16)
    scale = HEAD_DIM ** -0.5
    for _ in range(3):
        batch.run(kernels, scale)
    times = []
    for _ in range(reps):
        t0 = clock()
        batch.run(kernels, scale)
        times.append(clock() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    kernels = load_kernels(mode="compiled")
    import bladellm
    print(f"# {Path(bladellm.__file__).parent.parent}, {getattr(kernels, 'isa', '')}, "
          f"threads {args.threads}, clock {args.clock}, median of {args.reps}")
    for name, (q_lens, seq_lens) in CASES.items():
        us = time_case(kernels, q_lens, seq_lens, args.reps, clock)
        print(f"{name:24s} {us:10.1f} us")


if __name__ == "__main__":
    main()
