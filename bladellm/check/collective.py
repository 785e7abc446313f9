"""All-reduce across ``--tensor_parallel_size`` ranks with the backend the engine would use
(NCCL on GPUs, gloo on CPU): processes are spawned, a known tensor is summed, the result is
verified and the bus bandwidth reported."""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
from datetime import timedelta

from bladellm.check.result import FAILED, PASS, CheckResult

NUM_ELEMENTS = 1 << 22  # 16 MiB of fp32
ITERS = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, backend: str, port: int, out: mp.Queue) -> None:
    try:
        import torch
        import torch.distributed as dist

        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        x = torch.full((NUM_ELEMENTS,), float(rank + 1), device=device)
        dist.all_reduce(x)  # warm-up, and the value to verify
        ok = bool(torch.all(x == world * (world + 1) / 2).item())
        if backend == "nccl":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(ITERS):
            dist.all_reduce(x)
        if backend == "nccl":
            torch.cuda.synchronize(device)
        out.put((rank, ok, (time.perf_counter() - start) / ITERS, ""))
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - reported by the parent as FAILED
        out.put((rank, False, 0.0, f"{type(exc).__name__}: {exc}"))


def check_all_reduce(world: int, backend: str, timeout: float = 120.0) -> CheckResult:
    name = f"all_reduce_{backend}"
    if backend == "nccl":
        import torch

        if torch.cuda.device_count() < world:
            return CheckResult(name, FAILED, f"--tensor_parallel_size {world} needs {world} "
                                             f"GPUs, {torch.cuda.device_count()} visible")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, backend, port, out), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    replies, deadline = [], time.monotonic() + timeout
    try:
        while len(replies) < world:
            replies.append(out.get(timeout=max(0.1, deadline - time.monotonic())))
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    errors = [r[3] for r in replies if r[3]]
    if len(replies) < world:
        return CheckResult(name, FAILED, f"{world - len(replies)} of {world} ranks did not "
                                         f"answer within {timeout:.0f} s")
    if errors:
        return CheckResult(name, FAILED, f"{world} ranks: {errors[0]}")
    if not all(r[1] for r in replies):
        return CheckResult(name, FAILED, f"{world} ranks: wrong all-reduce result")
    seconds = max(r[2] for r in replies)
    bus = 2 * (world - 1) / world * NUM_ELEMENTS * 4 / seconds
    return CheckResult(name, PASS, f"{world} ranks, {NUM_ELEMENTS * 4 >> 20} MiB fp32: result "
                                   f"correct, {seconds * 1e3:.1f} ms, bus bandwidth "
                                   f"{bus / 1e9:.2f} GB/s")
