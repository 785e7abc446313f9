"""GPU: the Triton quantized GEMMs (bladellm/kernels/triton/quant_gemm.py) against a 16-bit
``torch.matmul`` on the same shapes, in one run. Needs a CUDA GPU and triton.

    python benchmarks/triton_quant_gemm.py            # 88M, demo (135M) and 7B linear shapes

Prints one JSON line per (shape, M): microseconds per call (median of CUDA-event timings) for
fp16 matmul, W4A16 g128 (asym), W8A16 per channel and W8A8 (incl. the per-token quantization of
the activations), and each one's speed-up over fp16.
"""

from __future__ import annotations

import json
import statistics

import torch

from bladellm.kernels.triton import quant_gemm as qg

SHAPES = {  # name -> (K, N) of the linear layers that dominate a decode step
    "88m-gate_up": (768, 4096), "88m-down": (2048, 768),
    "smollm2-135m-gate_up": (576, 3072), "smollm2-135m-down": (1536, 576),
    "7b-qkv": (4096, 12288), "7b-gate_up": (4096, 22016), "7b-down": (11008, 4096),
}


def _time_us(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    dev = "cuda"
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "triton": __import__("triton").__version__}))
    for name, (k, n) in SHAPES.items():
        w16 = torch.randn(k, n, device=dev, dtype=torch.float16) * 0.02
        v4 = torch.randint(0, 16, (k, n), device=dev)
        q4, s4 = qg.pack_wna16(v4, 4), torch.rand(k // 128, n, device=dev, dtype=torch.float16)
        z4 = torch.randint(0, 16, (k // 128, n), device=dev, dtype=torch.int32)
        q8, s8 = qg.pack_wna16(torch.randint(0, 256, (k, n), device=dev), 8), \
            torch.rand(1, n, device=dev, dtype=torch.float16)
        wq = torch.randint(-127, 128, (k, n), device=dev, dtype=torch.int8)
        ws = torch.rand(n, device=dev)
        for m in (1, 16, 256):
            x = torch.randn(m, k, device=dev, dtype=torch.float16)
            row = {"shape": name, "K": k, "N": n, "M": m,
                   "fp16_us": _time_us(lambda: x @ w16),
                   "w4a16_g128_us": _time_us(lambda: qg.wna16_gemm(x, q4, s4, z4, 4, 128)),
                   "w8a16_us": _time_us(lambda: qg.wna16_gemm(x, q8, s8, None, 8, k)),
                   "w8a8_us": _time_us(lambda: qg.w8a8_gemm(*qg.per_token_quant_int8(x), wq, ws,
                                                            torch.float16))}
            for key in ("w4a16_g128_us", "w8a16_us", "w8a8_us"):
                row[key.replace("_us", "_speedup")] = round(row["fp16_us"] / row[key], 2)
            print(json.dumps({k_: round(v, 1) if isinstance(v, float) else v
                              for k_, v in row.items()}))


if __name__ == "__main__":
    main()
