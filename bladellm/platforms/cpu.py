"""CPU features: read once from ``/proc/cpuinfo`` and kept in one small dataclass.

Kernel selection, ``--dtype auto`` and thread defaults all decide from a ``CpuInfo``; tests build
one with a faked flag set instead of patching the machine.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuInfo:
    model_name: str
    flags: frozenset[str]
    num_cpus: int  # CPUs this process may run on (affinity), not the machine's total

    @property
    def has_avx2(self) -> bool:
        return {"avx2", "fma"} <= self.flags

    @property
    def has_avx512(self) -> bool:
        return {"avx512f", "avx512bw", "avx512vl"} <= self.flags

    @property
    def has_avx512_bf16(self) -> bool:
        return self.has_avx512 and "avx512_bf16" in self.flags

    @property
    def has_amx(self) -> bool:
        return {"amx_tile", "amx_bf16"} <= self.flags

    @property
    def has_native_bf16(self) -> bool:
        """bf16 GEMMs run at or above fp32 speed (AVX-512-BF16 or AMX); without it oneDNN
        emulates bf16 and a GEMM is several times slower than fp32."""
        return self.has_avx512_bf16 or self.has_amx

    @property
    def isa(self) -> str:
        """The best ISA level kernels may target: amx > avx512_bf16 > avx512 > avx2 > generic."""
        for name, ok in (("amx", self.has_amx), ("avx512_bf16", self.has_avx512_bf16),
                         ("avx512", self.has_avx512), ("avx2", self.has_avx2)):
            if ok:
                return name
        return "generic"

    def describe(self) -> str:
        interesting = sorted(f for f in self.flags
                             if f.startswith(("avx", "amx", "fma")) or f in ("f16c",))
        return f"{self.model_name}, {self.num_cpus} CPUs, ISA {self.isa} ({' '.join(interesting)})"


def _affinity_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def parse_cpuinfo(text: str, num_cpus: int) -> CpuInfo:
    """``CpuInfo`` from the text of ``/proc/cpuinfo`` (the first processor's entry)."""
    model, flags = platform.processor() or "unknown CPU", ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model in ("", "unknown CPU", platform.processor()):
            model = value.strip()
        elif key == "flags" and not flags:
            flags = value
    return CpuInfo(model_name=model or "unknown CPU", flags=frozenset(flags.split()),
                   num_cpus=num_cpus)


@functools.lru_cache(maxsize=1)
def detect_cpu() -> CpuInfo:
    """This machine's CPU (cached: the hardware does not change while we run)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        text = ""
    return parse_cpuinfo(text, _affinity_cpus())
