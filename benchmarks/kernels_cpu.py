"""Compiled CPU kernels vs their plain-PyTorch twins vs what the engine ran before.

Shapes of the 88M model (hidden 768, 12 query heads / 4 KV heads, head_dim 64, intermediate
2048, KV block 16). Attention cases: decode batch 1 @ 600 tokens, batch 32 @ 600, batch 64 @
150..500 tokens, and one 512-token prefill chunk after a 512-token cached prefix. "before" for
attention is ``TorchAttentionBackend.forward`` as of commit 916b9a0 (gather + torch SDPA in
length-sorted decode chunks, one SDPA per prefill, with its KV-cache write; loaded from git
history); it is compared with the compiled ``reshape_and_cache`` + ``paged_attention``. For the
norms, rotary and SiLU the reference *is* what the layers ran before.

Each number is the median over ``--reps`` timed calls after warm-up. On a shared machine,
wall-clock medians of multi-threaded calls measure the neighbours as much as the kernels (a
parallel region waits for its slowest thread); ``--clock cpu --threads 1`` times the calling
thread's CPU time instead, which a descheduled thread does not inflate.

    python benchmarks/kernels_cpu.py --threads 2 --reps 30
    python benchmarks/kernels_cpu.py --threads 1 --clock cpu
    python benchmarks/kernels_cpu.py --gemm --threads 1 --clock cpu --reps 15

``--gemm``: the linear layers of the 88M model and SmolLM2-135M at M = 1..256 rows: F.linear
(what the engine ran before), oneDNN with a prepacked weight, MKL packed (fp32), the compiled
small-M kernel alone, and ``Kernels.linear`` without / with ``pack_linear_weight``. The same
weight is reused call after call, so the smaller ones run from cache (a decode step streams
them from DRAM: ``benchmarks/linear_streamed.py`` measures that case).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bladellm.kernels import Kernels, resolve_kernels
from bladellm.platforms.cpu import detect_cpu

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, HIDDEN, INTERMEDIATE = 12, 4, 64, 16, 768, 2048


BEFORE_COMMIT = "916b9a0"  # the last engine whose attention was gather + torch SDPA


def load_before() -> types.ModuleType:
    """The old torch_backend module (and the metadata it expects) from git history."""
    root = Path(__file__).resolve().parent.parent

    def load(name: str, path: str, replace: tuple[str, str] = ("", "")) -> types.ModuleType:
        src = subprocess.run(["git", "-C", str(root), "show", f"{BEFORE_COMMIT}:{path}"],
                             check=True, capture_output=True, text=True).stdout
        module = sys.modules[name] = types.ModuleType(name)
        exec(compile(src.replace(*replace), f"{BEFORE_COMMIT}:{path}", "exec"), module.__dict__)
        return module

    load("before_backend", "bladellm/attention/backend.py")
    return load("before_torch_backend", "bladellm/attention/torch_backend.py",
                ("from bladellm.attention.backend import", "from before_backend import"))


CLOCK: Callable[[], float] = time.perf_counter


def time_us(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(reps):
        start = CLOCK()
        fn()
        samples.append(CLOCK() - start)
    return statistics.median(samples) * 1e6


class AttentionCase:
    """A batch laid out as the engine does: decodes first, shuffled block ids."""

    def __init__(self, q_lens: list[int], seq_lens: list[int], dtype: torch.dtype) -> None:
        g = torch.Generator().manual_seed(0)
        blocks = [-(-s // BLOCK_SIZE) for s in seq_lens]
        num_blocks = sum(blocks) + 8
        ids = torch.randperm(num_blocks, generator=g)
        self.tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int64)
        used = 0
        for r, n in enumerate(blocks):
            self.tables[r, :n] = ids[used:used + n]
            used += n
        self.kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
                                    generator=g).to(dtype)
        T = sum(q_lens)
        qkv = torch.randn(T, NUM_HEADS + 2 * NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
        self.q = qkv[:, :NUM_HEADS]
        self.k = qkv[:, NUM_HEADS:NUM_HEADS + NUM_KV_HEADS]
        self.v = qkv[:, NUM_HEADS + NUM_KV_HEADS:]
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        slots = []
        for r, (n, s) in enumerate(zip(q_lens, seq_lens)):
            for pos in range(s - n, s):
                slots.append(int(self.tables[r, pos // BLOCK_SIZE]) * BLOCK_SIZE
                             + pos % BLOCK_SIZE)
        self.slots = torch.tensor(slots, dtype=torch.int64)
        self.meta = sys.modules["before_backend"].AttentionMetadata(
            num_reqs=len(q_lens), num_decodes=sum(1 for n in q_lens if n == 1),
            num_actual_tokens=T, query_start_loc=torch.tensor(starts),
            seq_lens=torch.tensor(seq_lens), block_tables=self.tables, slot_mapping=self.slots,
            query_start_loc_cpu=starts, seq_lens_cpu=list(seq_lens), max_seq_len=max(seq_lens))
        # What the integrated backend would hand the kernel: int32, converted once per step.
        self.tables32 = self.tables.to(torch.int32)
        self.starts32 = torch.tensor(starts, dtype=torch.int32)
        self.lens32 = torch.tensor(seq_lens, dtype=torch.int32)
        self.out = torch.empty(self.q.shape, dtype=dtype)
        self.flops = sum(4 * NUM_HEADS * HEAD_DIM * sum(s - n + j + 1 for j in range(n))
                         for n, s in zip(q_lens, seq_lens))

    def run(self, kernels) -> None:
        kernels.paged_attention(self.out, self.q, self.kv_cache[0], self.kv_cache[1],
                                self.tables32, self.starts32, self.lens32, HEAD_DIM ** -0.5)

    def run_with_write(self, kernels) -> None:
        kernels.reshape_and_cache(self.k, self.v, self.kv_cache[0], self.kv_cache[1], self.slots)
        self.run(kernels)

    def run_before(self, backend: Any) -> None:
        backend.forward(self.q, self.k, self.v, self.kv_cache, self.meta, HEAD_DIM ** -0.5)


def attention_cases(dtype: torch.dtype) -> dict[str, AttentionCase]:
    g = torch.Generator().manual_seed(1)
    mixed = torch.randint(150, 501, (64,), generator=g).tolist()
    return {
        "decode b1 @600": AttentionCase([1], [600], dtype),
        "decode b32 @600": AttentionCase([1] * 32, [600] * 32, dtype),
        "decode b64 @150..500": AttentionCase([1] * 64, mixed, dtype),
        "prefill 512 after 512": AttentionCase([512], [1024], dtype),
    }


def bench_attention(dtype: torch.dtype, reps: int, compiled, reference) -> None:
    backend = load_before().TorchAttentionBackend()
    print(f"\n## paged attention, {dtype} (us per call, one layer)")
    print("| case | compiled | ref | before (torch backend) | compiled+write | "
          "before / compiled+write | GFLOP/s compiled |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, case in attention_cases(dtype).items():
        t_c = time_us(lambda: case.run(compiled), reps)
        t_r = time_us(lambda: case.run(reference), max(3, reps // 5))
        t_b = time_us(lambda: case.run_before(backend), reps)
        t_cw = time_us(lambda: case.run_with_write(compiled), reps)
        print(f"| {name} | {t_c:.0f} | {t_r:.0f} | {t_b:.0f} | {t_cw:.0f} | {t_b / t_cw:.1f}x "
              f"| {case.flops / t_c / 1e3:.1f} |")


def bench_elementwise(dtype: torch.dtype, reps: int, compiled, reference) -> None:
    print(f"\n## norms, rotary, silu, {dtype} (us per call; ref = the layers' code before)")
    print("| kernel | tokens | compiled | ref | ref / compiled |")
    print("|---|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(HIDDEN, generator=g).to(dtype)
    positions_max = 2048
    cos = torch.randn(positions_max, HEAD_DIM // 2, generator=g).to(dtype)
    sin = torch.randn(positions_max, HEAD_DIM // 2, generator=g).to(dtype)
    for T in (1, 32, 512):
        x = torch.randn(T, HIDDEN, generator=g).to(dtype)
        res = torch.randn(T, HIDDEN, generator=g).to(dtype)
        qkv = torch.randn(T, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, generator=g).to(dtype)
        q, k = qkv[:, :NUM_HEADS * HEAD_DIM], qkv[:, NUM_HEADS * HEAD_DIM:-NUM_KV_HEADS * HEAD_DIM]
        pos = torch.randint(0, positions_max, (T,), generator=g)
        gate_up = torch.randn(T, 2 * INTERMEDIATE, generator=g).to(dtype)
        cases = {
            "rms_norm": lambda kk: kk.rms_norm(x, weight, 1e-5),
            "fused_add_rms_norm": lambda kk: kk.fused_add_rms_norm(x, res, weight, 1e-5),
            "rotary (out of place)": lambda kk: kk.rotary_embedding(
                pos, q, k, cos, sin, HEAD_DIM, HEAD_DIM, inplace=False),
            "silu_and_mul": lambda kk: kk.silu_and_mul(gate_up),
        }
        for name, fn in cases.items():
            t_c = time_us(lambda: fn(compiled), reps)
            t_r = time_us(lambda: fn(reference), reps)
            print(f"| {name} | {T} | {t_c:.1f} | {t_r:.1f} | {t_r / t_c:.1f}x |")


GEMM_SHAPES = {  # name: (N, K)
    "88M qkv": (1280, 768), "88M o": (768, 768), "88M gate_up": (4096, 768),
    "88M down": (768, 2048), "88M lm_head": (8192, 768),
    "135M qkv": (960, 576), "135M o": (576, 576), "135M gate_up": (3072, 576),
    "135M down": (576, 1536), "135M lm_head": (49152, 576),
}
GEMM_ROWS = (1, 2, 4, 8, 16, 32, 64, 256)


def time_us_budget(fn: Callable[[], object], reps: int, budget_s: float = 1.5) -> float:
    """time_us with fewer reps for slow calls (the large-M lm_head ones)."""
    start = time.perf_counter()
    fn()
    once = time.perf_counter() - start
    return time_us(fn, max(5, min(reps, int(budget_s / max(once, 1e-6)))))


def gemm_methods(dtype: torch.dtype, w: torch.Tensor, M: int, compiled) -> dict:
    """name -> zero-arg callable taking x; prepacking happens here, outside the timing."""
    methods = {"F.linear": lambda x: torch.nn.functional.linear(x, w)}
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, M)
        methods["onednn packed"] = lambda x: torch.ops.mkldnn._linear_pointwise(
            x, packed, None, "none", [], "")
    except (RuntimeError, AttributeError):
        pass
    if dtype == torch.float32:
        try:
            mkl_w = torch.ops.mkl._mkl_reorder_linear_weight(w, M)
            methods["mkl packed"] = lambda x: torch.ops.mkl._mkl_linear(x, mkl_w, w, None, M)
        except (RuntimeError, AttributeError):
            pass
    # The kernel itself (bypassing the crossover), and what Kernels.linear dispatches to.
    lib_linear, code = compiled._linear, 0 if dtype == torch.float32 else 1
    N, K = w.shape

    def kernel(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty((M, N), dtype=dtype)
        lib_linear(out.data_ptr(), x.data_ptr(), w.data_ptr(), None, M, N, K, K, N, code,
                   torch.get_num_threads())
        return out

    methods["kernel"] = kernel
    methods["Kernels.linear"] = lambda x: compiled.linear(x, w)
    packed_w = compiled.pack_linear_weight(w)
    methods["Kernels.linear packed"] = lambda x: compiled.linear(x, w, None, packed_w)
    return methods


def bench_gemm(dtype: torch.dtype, reps: int, compiled, rows: tuple[int, ...]) -> None:
    print(f"\n## linear (x [M, K] @ w[N, K].T), {dtype}: us per call; GB/s = weight bytes / "
          "time; ratio = F.linear / best other")
    g = torch.Generator().manual_seed(0)
    names = None
    for shape, (N, K) in GEMM_SHAPES.items():
        w = torch.randn(N, K, generator=g).to(dtype)
        for M in rows:
            x = torch.randn(M, K, generator=g).to(dtype)
            methods = gemm_methods(dtype, w, M, compiled)
            if names is None:
                names = list(methods)
                print("| shape | M | " + " | ".join(names) + " | kernel GB/s | F.linear / kernel |")
                print("|---|---:|" + "---:|" * (len(names) + 2))
            times = {n: time_us_budget(lambda: fn(x), reps) for n, fn in methods.items()}
            gbs = w.numel() * w.element_size() / times["kernel"] / 1e3
            cells = " | ".join(f"{times[n]:.1f}" if n in times else "-" for n in names)
            print(f"| {shape} {N}x{K} | {M} | {cells} | {gbs:.1f} | "
                  f"{times['F.linear'] / times['kernel']:.2f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--gemm", action="store_true",
                        help="only the linear-layer section (small-M GEMM shapes)")
    parser.add_argument("--rows", default=",".join(map(str, GEMM_ROWS)),
                        help="M values of the --gemm section")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: the calling thread's CPU time (needs --threads 1)")
    args = parser.parse_args()
    if args.clock == "cpu":
        if args.threads != 1:
            parser.error("--clock cpu counts only the calling thread: use --threads 1")
        global CLOCK
        CLOCK = time.thread_time
    torch.set_num_threads(args.threads)
    compiled = resolve_kernels("auto", "cpu")
    if compiled.name != "compiled":
        raise SystemExit("compiled kernels unavailable (see the warning above)")
    print(f"CPU: {detect_cpu().describe()}; torch {torch.__version__}, {args.threads} threads; "
          f"kernels: {compiled.describe()}; {args.clock} clock, medians of {args.reps} reps")
    reference = Kernels()  # the plain-PyTorch twins
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        if args.gemm:
            bench_gemm(dtype, args.reps, compiled, tuple(map(int, args.rows.split(","))))
            continue
        bench_attention(dtype, args.reps, compiled, reference)
        bench_elementwise(dtype, args.reps, compiled, reference)


if __name__ == "__main__":
    main()
