"""GPUs: devices, driver / CUDA / Triton versions, measured peak FLOP/s and memory bandwidth of
each device, and the largest difference between devices (one slow card slows every TP step)."""

from __future__ import annotations

import subprocess
from importlib import metadata

from bladellm.check.result import FAILED, PASS, WARNING, CheckResult

MAX_SPREAD = 0.10  # devices further apart than this (relative to the fastest) get a warning


def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return out.splitlines()[0].strip() if out.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown (nvidia-smi not found)"


def _triton_version() -> str | None:
    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return None


def measure_device(index: int, size: int = 8192, iters: int = 20) -> tuple[float, float]:
    """(bf16 matmul FLOP/s, device memory bandwidth in bytes/s) of one device, timed with CUDA
    events after a warm-up."""
    import torch

    dev = torch.device("cuda", index)
    a = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    src = torch.empty(256 << 20, device=dev, dtype=torch.uint8)  # 256 MiB
    dst = torch.empty_like(src)

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize(dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000 / iters

    with torch.cuda.device(dev):
        flops = 2 * size ** 3 / timed(lambda: torch.matmul(a, b))
        bandwidth = 2 * src.numel() / timed(lambda: dst.copy_(src))  # read + write
    return flops, bandwidth


def spread(values: list[float]) -> float:
    """(fastest - slowest) / fastest; 0 for one value."""
    return (max(values) - min(values)) / max(values) if values and max(values) > 0 else 0.0


def check_gpus(device: str) -> list[CheckResult]:
    import torch

    if not torch.cuda.is_available():
        if device == "cuda":
            return [CheckResult("gpu", FAILED, "no CUDA device is visible (driver, "
                                               "CUDA_VISIBLE_DEVICES or a CPU-only torch build)")]
        return [CheckResult("gpu", PASS, "no GPU visible; BladeLLM serves on the CPU")]
    n = torch.cuda.device_count()
    names = [torch.cuda.get_device_name(i) for i in range(n)]
    mems = [torch.cuda.get_device_properties(i).total_memory / (1 << 30) for i in range(n)]
    results = [CheckResult("gpu_devices", PASS, "; ".join(
        f"cuda:{i} {names[i]} {mems[i]:.0f} GiB" for i in range(n)))]
    triton = _triton_version()
    versions = (f"driver {_driver_version()}, CUDA {torch.version.cuda}, "
                f"Triton {triton or 'not installed'}")
    results.append(CheckResult("gpu_software", PASS if triton else WARNING,
                               versions + ("" if triton else ": the GPU kernels need Triton")))
    perf = []
    for i in range(n):
        try:
            flops, bw = measure_device(i)
        except RuntimeError as exc:  # out of memory, a broken device
            results.append(CheckResult(f"gpu{i}_perf", FAILED, f"measurement failed: {exc}"))
            continue
        perf.append((flops, bw))
        results.append(CheckResult(f"gpu{i}_perf", PASS, f"{flops / 1e12:.1f} TFLOP/s bf16 "
                                                         f"matmul, {bw / 1e9:.0f} GB/s memory"))
    if len(perf) > 1:
        f_spread, b_spread = spread([p[0] for p in perf]), spread([p[1] for p in perf])
        worst = max(f_spread, b_spread)
        results.append(CheckResult(
            "gpu_consistency", WARNING if worst > MAX_SPREAD else PASS,
            f"max difference between devices: FLOP/s {f_spread:.1%}, bandwidth {b_spread:.1%}"
            f" (warn above {MAX_SPREAD:.0%})"))
    return results
