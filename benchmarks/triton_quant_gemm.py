"""GPU: the Triton quantized GEMMs (bladellm/kernels/triton/quant_gemm.py) against the 16-bit
cuBLAS GEMM (``torch.matmul``) on the same shapes, in one run. Needs a CUDA GPU and triton.

    python benchmarks/triton_quant_gemm.py --out results.jsonl          # shipped tiles
    python benchmarks/triton_quant_gemm.py --sweep --out sweep.jsonl    # + a tile sweep

Per (shape, M): microseconds per call (median of CUDA-event timings over rotating input sets,
so that weights come from HBM, not L2) for bf16 cuBLAS, W4A16 g128 (asym, GPTQ/AWQ layout),
W8A16 per channel and W8A8 (including the per-token quantization of the activations), each
one's speed-up over bf16, and at M = 1 the achieved bandwidth (the fewest bytes the call must
read: packed weights, scales, zeros, activations) against a measured device-to-device copy.
``--sweep`` also times a grid of tiles for W4A16 and reports the best beside the shipped choice.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from bladellm.kernels.triton import quant_gemm as qg

SHAPES = {  # name -> (K, N) of the linear layers that dominate a decode step
    "smollm2-135m-gate_up": (576, 3072), "smollm2-135m-down": (1536, 576),
    "llama3-8b-qkv": (4096, 6144), "llama3-8b-o": (4096, 4096),
    "llama3-8b-gate_up": (4096, 28672), "llama3-8b-down": (14336, 4096),
}
MS = (1, 16, 64, 256, 1024)


def _time_us(fns: list, reps: int = 20) -> float:
    """GPU time per call: ``reps`` calls (cycling through ``fns``, the same op on different
    buffers) captured in one CUDA graph, replayed; median over replays / reps. The graph removes
    the host's launch cost, as the engine's decode CUDA graphs do."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for fn in fns:  # warm the allocator's graph pool on this stream
            fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(reps):
                fns[i % len(fns)]()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


def _eager_us(fn, iters: int = 20) -> float:
    """Wall time per call launched from Python one at a time (host launch cost included)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy."""
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = _time_us([lambda: b.copy_(a)], reps=5)
    return 2 * a.numel() / (us * 1e-6)


def _copies(k: int, n: int) -> int:
    # Enough weight sets that together they are several times the L2 (50-60 MB on Hopper).
    return max(2, min(64, (400 << 20) // (k * n * 2)))


def sweep_w4a16(name: str, x: torch.Tensor, q4: list, s4: torch.Tensor, z4: torch.Tensor,
                shipped_us: float, emit) -> None:
    """Time a grid of tiles for W4A16 at this shape; report the best beside the shipped one."""
    m, k = x.shape
    best, failed = None, 0
    bm = 16 if m <= 16 else (64 if m <= 64 else 128)
    for bn in (64, 128, 256):
        for bk in (128, 256):
            for split in (1, 2, 4, 8):
                for warps, stages in ((4, 3), (4, 4), (8, 3)):
                    if split > 1 and split > k // bk:
                        continue
                    t = qg.GemmTiles(bm, bn, bk, split, warps, stages)
                    try:
                        us = _time_us([lambda q=q: qg.wna16_gemm(x, q, s4, z4, 4, 128, tiles=t)
                                       for q in q4], reps=10)
                    except Exception:  # out of shared memory and the like
                        failed += 1
                        continue
                    if best is None or us < best[0]:
                        best = (us, str(t))
    if best is not None:
        emit({"sweep": name, "M": m, "best_w4a16_us": best[0], "best_tiles": best[1],
              "shipped_w4a16_us": shipped_us, "configs_failed": failed})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="also write the JSON lines here")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--ms", nargs="+", type=int, default=list(MS))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    out = open(args.out, "w") if args.out else None

    def emit(row: dict) -> None:
        line = json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    dev = "cuda"
    bw = copy_bandwidth()
    emit({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
          "triton": __import__("triton").__version__, "copy_GBps": bw / 1e9,
          "sms": torch.cuda.get_device_properties(0).multi_processor_count})
    torch.manual_seed(0)
    for name in args.shapes:
        k, n = SHAPES[name]
        c = _copies(k, n)
        g = 128 if k % 128 == 0 else 64  # SmolLM2's K = 576 takes groups of 64
        w16 = [torch.randn(k, n, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(c)]
        q4 = [qg.pack_wna16(torch.randint(0, 16, (k, n), device=dev), 4) for _ in range(c)]
        s4 = torch.rand(k // g, n, device=dev, dtype=torch.float32) * 0.01
        z4 = torch.randint(0, 16, (k // g, n), device=dev, dtype=torch.int32)
        q8 = [qg.pack_wna16(torch.randint(0, 256, (k, n), device=dev), 8) for _ in range(c)]
        s8 = torch.rand(1, n, device=dev, dtype=torch.float32) * 0.01
        # [N, K] stored, K-major [K, N] view: the layout TritonW8A8Linear keeps.
        wq = [torch.randint(-127, 128, (n, k), device=dev, dtype=torch.int8).t()
              for _ in range(c)]
        ws = torch.rand(n, device=dev)
        for m in args.ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            # Correctness at this shape first: each kernel against its twin (fresh inputs).
            ref4 = qg.wna16_gemm_ref(x, q4[0], s4, z4, 4, g).float()
            err4 = ((qg.wna16_gemm(x, q4[0], s4, z4, 4, g).float() - ref4).norm()
                    / ref4.norm()).item()
            xq, xs = qg.per_token_quant_int8(x)
            ref8 = qg.w8a8_gemm_ref(xq, xs, wq[0], ws, torch.float32)
            err8 = ((qg.w8a8_gemm(xq, xs, wq[0], ws, torch.bfloat16).float() - ref8).norm()
                    / ref8.norm()).item()
            row = {"shape": name, "K": k, "N": n, "M": m, "weight_sets": c,
                   "w4a16_rel_err": err4, "w8a8_rel_err": err8,
                   "tiles_w4": str(qg.wna16_tiles(m, n, k, 4, g, x.device)),
                   "bf16_us": _time_us([lambda w=w: x @ w for w in w16]),
                   "w4a16_g128_us": _time_us([lambda q=q: qg.wna16_gemm(x, q, s4, z4, 4, g)
                                              for q in q4]),
                   "w4a16_fused_us": _time_us([lambda q=q: qg.wna16_gemm(
                       x, q, s4, z4, 4, g, tiles=qg.wna16_tiles(m, n, k, 4, g, x.device))
                       for q in q4]),
                   "w4a16_dequant_us": _time_us([lambda q=q: x @ qg.dequant_wna16(
                       q, s4, z4, 4, g, x.dtype) for q in q4]),
                   "w4a16_eager_us": _eager_us(lambda: qg.wna16_gemm(x, q4[0], s4, z4, 4, g)),
                   "bf16_eager_us": _eager_us(lambda: x @ w16[0]),
                   "w8a16_us": _time_us([lambda q=q: qg.wna16_gemm(x, q, s8, None, 8, k)
                                         for q in q8]),
                   "w8a8_us": _time_us([lambda w=w: qg.w8a8_gemm(*qg.per_token_quant_int8(x), w,
                                                                 ws, torch.bfloat16)
                                        for w in wq])}
            for key in ("w4a16_g128_us", "w8a16_us", "w8a8_us"):
                row[key.replace("_us", "_speedup")] = row["bf16_us"] / row[key]
            if m == 1:
                act = k * 2 + n * 2
                bytes_ = {"bf16": k * n * 2 + act, "w4a16_g128": k * n // 2 + s4.numel() * 8 + act,
                          "w8a16": k * n + n * 4 + act, "w8a8": k * n + n * 4 + act}
                for key, b in bytes_.items():
                    row[f"{key}_frac_copy_bw"] = b / (row[f"{key}_us"] * 1e-6) / bw
            emit(row)
            if args.sweep and m == 1 and name.startswith("llama3"):
                sweep_w4a16(name, x, q4, s4, z4, row["w4a16_g128_us"], emit)
    if out:
        out.close()


if __name__ == "__main__":
    main()
