"""Run every check in order; a check that crashes is reported as FAILED, never a traceback."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from bladellm.check.result import FAILED, CheckResult
from bladellm.config import EngineConfig


@dataclass
class CheckOptions:
    engine: EngineConfig | None  # None when the flags did not make a valid config
    host: str = "0.0.0.0"
    ports: list[int] = field(default_factory=lambda: [8081])
    tensor_parallel_size: int = 1  # as given, even where the engine rejects it


def _guard(name: str, fn: Callable[[], CheckResult | list[CheckResult]]) -> list[CheckResult]:
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others
        return [CheckResult(name, FAILED, f"the check crashed: {type(exc).__name__}: {exc}")]
    return out if isinstance(out, list) else [out]


def run_checks(opts: CheckOptions) -> list[CheckResult]:
    from bladellm.check import collective, cpu, gpu, memory, network, software
    from bladellm.platforms.cpu import detect_cpu

    info = detect_cpu()
    num_threads = opts.engine.parallel.num_threads if opts.engine else None
    results = _guard("python", software.check_python)
    results += _guard("packages", software.check_packages)
    results += _guard("cpu_isa", lambda: cpu.check_cpu_isa(info))
    results += _guard("cpu_threads", lambda: cpu.check_threads(info, num_threads))
    results += _guard("shm", cpu.check_shm)
    if opts.engine is not None:
        engine = opts.engine
        results += _guard("memory", lambda: memory.check_memory(engine))
    device = opts.engine.device if opts.engine else "cpu"
    results += _guard("gpu", lambda: gpu.check_gpus(device))
    if opts.tensor_parallel_size > 1:
        import torch

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        results += _guard(f"all_reduce_{backend}", lambda: collective.check_all_reduce(
            opts.tensor_parallel_size, backend))
    for port in opts.ports:
        results += _guard(f"port_{port}", lambda p=port: network.check_port(opts.host, p))
    return results
