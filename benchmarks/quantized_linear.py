"""Quantized linear kernels and quantized end-to-end decoding on this CPU, vs fp32, same run.

``--kernels``: the linear layers of the 88M model (hidden 768, intermediate 2048, 12/4 heads of
64; benchmarks/offline_throughput.py) at M = 1, 8, 32, 256 rows: the engine's fp32 path
(``Kernels.linear`` with its load-time packed weight), W8A8 (int8 weights, per-token int8
activations, fbgemm), W4A16 and W8A16 (weight-only, group 128) through every weight-only kernel
(dequant + GEMM, ATen int4) and through the one the engine picks. Median per call over
``--reps`` calls; ``--clock cpu`` times the calling thread's CPU time (robust on a shared machine,
meaningful with ``--threads 1``).

``--e2e``: the 88M model with random weights, fp32 and quantized min-max into a W8A8
(compressed-tensors int-quantized) and a W4A16 (GPTQ 4-bit, group 128) checkpoint by the test
packers (tests/quant_checkpoints.py); single-stream TBT (one request, T = ``--tbt_tokens`` output
tokens after a 32-token prompt: (t(T + 1 tokens) - t(1 token)) / T, best of 2) and offline
throughput (``--num_prompts`` requests, 64 in / 64 out, output tok/s) through ``bladellm.LLM``;
where the CPU has native bf16 the fp32 checkpoint also runs at ``--dtype bfloat16``.

    python benchmarks/quantized_linear.py --kernels --threads 1 --clock cpu
    python benchmarks/quantized_linear.py --e2e --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from bladellm.kernels import resolve_kernels  # noqa: E402
from bladellm.quantization import cpu_kernels  # noqa: E402
from bladellm.quantization.int_weight import IntWeight, default_g_idx  # noqa: E402

warnings.filterwarnings("ignore", message=".*quantized tensor creation.*")

SHAPES_88M = {"qkv": (1280, 768), "o": (768, 768), "gate_up": (4096, 768), "down": (768, 2048)}
ROWS = (1, 8, 32, 256)


def _time(fn, reps: int, clock) -> float:
    fn()
    fn()
    times = []
    for _ in range(reps):
        t = clock()
        fn()
        times.append(clock() - t)
    return statistics.median(times) * 1e6


def _int_weight(w: torch.Tensor, bits: int, group: int, signed: bool) -> IntWeight:
    n, k = w.shape
    g = w.view(n, k // group, group)
    if signed:  # symmetric
        qmax = (1 << (bits - 1)) - 1
        s = g.abs().amax(-1) / qmax
        q = torch.round(g / s[..., None]).clamp(-qmax - 1, qmax)
        zeros = None
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        s = (hi - lo) / ((1 << bits) - 1)
        zeros = torch.round(-lo / s)
        q = (torch.round(g / s[..., None]) + zeros[..., None]).clamp(0, (1 << bits) - 1)
        zeros = zeros.to(torch.int16)
    return IntWeight(q.view(n, k).to(torch.int16), s, zeros, default_g_idx(k, group), bits)


def bench_kernels(reps: int, clock) -> None:
    kernels = resolve_kernels("auto", "cpu")
    print(f"kernels: {kernels.describe()}; fbgemm: {cpu_kernels.has_fbgemm()}; "
          f"threads {torch.get_num_threads()}")
    print("| layer (N x K) | M | fp32 µs | W8A8 µs | W4A16 engine µs | W4A16 dequant+GEMM µs "
          "| W4A16 ATen int4 µs | W8A16 dequant+GEMM µs |")
    print("|---|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES_88M.items():
        w = torch.randn(n, k, generator=gen) * 0.02
        packed = kernels.pack_linear_weight(w)
        w8a8 = cpu_kernels.Int8DynamicLinear(_int_weight(w, 8, k, signed=True))
        w4 = _int_weight(w, 4, 128, signed=False)
        w4_engine = cpu_kernels.choose_weight_only_kernel(w4, kernels)
        w4_dequant = cpu_kernels.DequantLinear(w4, kernels)
        w4_aten = cpu_kernels.AtenInt4Linear(w4, w4_dequant)
        w8a16 = cpu_kernels.DequantLinear(_int_weight(w, 8, 128, signed=True), kernels)
        for m in ROWS:
            x = torch.randn(m, k, generator=gen)
            aten_call = (lambda: torch._weight_int4pack_mm_for_cpu(
                x, w4_aten.packed, 128, w4_aten.scales_and_zeros))
            cols = [_time(lambda: kernels.linear(x, w, None, packed), reps, clock),
                    _time(lambda: w8a8(x, None), reps, clock),
                    _time(lambda: w4_engine(x, None), reps, clock),
                    _time(lambda: w4_dequant(x, None), reps, clock),
                    _time(aten_call, reps, clock),
                    _time(lambda: w8a16(x, None), reps, clock)]
            print(f"| {name} ({n}x{k}) | {m} | " + " | ".join(f"{c:.0f}" for c in cols) + " |")


def _llm_numbers(model_dir: str, dtype: str, tbt_tokens: int,
                 num_prompts: int) -> tuple[float, float]:
    from bladellm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=dtype, max_model_len=256, max_num_seqs=32)
    try:
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(10, 8000, (32,), generator=gen).tolist()

        def run(prompts, tokens):
            params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - t

        run([prompt], 8)  # warm-up
        tbt = min((run([prompt], tbt_tokens + 1) - run([prompt], 1)) / tbt_tokens
                  for _ in range(2))
        prompts = [torch.randint(10, 8000, (64,), generator=gen).tolist()
                   for _ in range(num_prompts)]
        tput = num_prompts * 64 / run(prompts, 64)
        return tbt * 1e3, tput
    finally:
        llm.shutdown()


def _native_bf16() -> bool:
    from bladellm.platforms.cpu import detect_cpu

    return detect_cpu().has_native_bf16


def bench_e2e(workdir: Path, tbt_tokens: int, num_prompts: int) -> None:
    from offline_throughput import make_model_dir
    from quant_checkpoints import quantize_checkpoint

    fp32 = make_model_dir("llama-88m", workdir / "fp32")
    dirs = {"fp32": (fp32, "float32")}
    if _native_bf16():  # a bf16 row only where bf16 is native (elsewhere it is emulated)
        dirs["bf16 (the fp32 checkpoint at --dtype bfloat16)"] = (fp32, "bfloat16")
    for label, kwargs in (("W8A8 (compressed-tensors int8)", dict(fmt="ct-w8a8")),
                          ("W4A16 (GPTQ 4-bit g128)", dict(fmt="gptq", bits=4, group_size=128,
                                                            sym=True))):
        d = workdir / kwargs["fmt"]
        if not (d / "config.json").exists():
            quantize_checkpoint(fp32, d, **kwargs)
        dirs[label] = (str(d), "float32")
    print("| model | single-stream TBT ms | offline output tok/s |")
    print("|---|---|---|")
    base = None
    for label, (d, dtype) in dirs.items():
        tbt, tput = _llm_numbers(d, dtype, tbt_tokens, num_prompts)
        base = base or (tbt, tput)
        print(f"| {label} | {tbt:.2f} ({base[0] / tbt:.2f}x) | {tput:.0f} "
              f"({tput / base[1]:.2f}x) |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--e2e", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--tbt_tokens", type=int, default=128)
    ap.add_argument("--num_prompts", type=int, default=32)
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "bladellm-quant-88m"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}")
    if args.kernels or not args.e2e:
        with torch.inference_mode():
            bench_kernels(args.reps, clock)
    if args.e2e:
        bench_e2e(Path(args.workdir), args.tbt_tokens, args.num_prompts)


if __name__ == "__main__":
    main()
