"""Compile the CPU kernels once per machine kind and cache the shared library.

Plain C++ without torch headers (a build takes seconds, not the minute ``torch/extension.h``
costs), loaded with ctypes. The cache key covers everything that changes the binary: the
sources, the flags, the compiler binary and the ISA, so a cache directory shared between
machines never hands one a library built for another. A hit costs a few file reads and a hash.

OpenMP: the torch wheel ships its own libgomp. A library linked to the system one would put a
second OpenMP runtime (and a second spinning thread pool) into the process, so we link to the
runtime torch already loaded, by its full path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

COMPILER = "g++"  # tests point this at a missing binary to exercise the fallback
SOURCE_DIR = Path(__file__).parent / "cpu"
HEADERS = ("vec.h", "attention_tiles.h", "kernel_args.h")
# Attention may fuse multiply-adds; the elementwise kernels must round exactly like torch.
SOURCES = {
    "attention.cpp": ["-ffp-contract=fast"],
    "norm.cpp": ["-ffp-contract=off"],
    "elementwise.cpp": ["-ffp-contract=off"],
    "linear.cpp": ["-ffp-contract=fast"],
    "linear_int4.cpp": ["-ffp-contract=fast"],
    "lora.cpp": ["-ffp-contract=fast"],
    "moe.cpp": ["-ffp-contract=off"],  # GEMMs are linear.cpp's; the weighted sum rounds as torch
    "sampling.cpp": ["-ffp-contract=off"],
    "decoder.cpp": ["-ffp-contract=off"],  # no arithmetic of its own: it calls the others
}
# -Wno-psabi: norm.cpp passes 16-lane vectors between inlined helpers in AVX2 builds too.
COMMON_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-fopenmp", "-fno-math-errno", "-Wall",
                "-Wno-psabi"]
ISA_FLAGS = {
    "amx": ["-march=x86-64-v4", "-mavx512bf16"],
    "avx512_bf16": ["-march=x86-64-v4", "-mavx512bf16"],
    "avx512": ["-march=x86-64-v4"],
    "avx2": ["-march=x86-64-v3"],
    "generic": [],
}
KEEP_BUILDS = 8  # per ISA: older libraries (other source versions) are deleted after a build
_OPENMP_RUNTIME = re.compile(r"/lib(gomp|iomp5|omp)[^/]*\.so[^/]*$")


class BuildError(RuntimeError):
    """The fast path cannot be built or loaded here; callers fall back to the reference."""


@dataclass(frozen=True)
class BuiltLibrary:
    lib: ctypes.CDLL
    path: Path
    cache_hit: bool
    seconds: float


def loaded_openmp_runtimes() -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux; [] elsewhere)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            paths = {line.split()[-1] for line in f if _OPENMP_RUNTIME.search(line.strip())}
    except OSError:
        return []
    return sorted(paths)


def _compiler_identity(compiler: str) -> tuple[str, str]:
    """(resolved path, identity string) of the compiler; identity changes with an upgrade
    without running it, so a cache hit never spawns the compiler."""
    found = shutil.which(compiler)
    if found is None:
        raise BuildError(f"no C++ compiler {compiler!r} on PATH")
    real = os.path.realpath(found)
    st = os.stat(real)
    return found, f"{real}:{st.st_size}:{int(st.st_mtime)}"


def cache_key(isa: str, compiler_id: str, openmp: str) -> str:
    h = hashlib.sha256()
    for name in (*HEADERS, *SOURCES):
        h.update(name.encode())
        h.update((SOURCE_DIR / name).read_bytes())
    h.update(repr((COMMON_FLAGS, SOURCES, ISA_FLAGS.get(isa), isa, compiler_id,
                   openmp)).encode())
    return h.hexdigest()[:20]


def _run_all(cmds: list[list[str]]) -> None:
    """Run the commands concurrently (one per source file: a cold build takes the time of the
    slowest file, not the sum); raise ``BuildError`` with the first failure's stderr."""
    procs = []
    try:
        for cmd in cmds:
            procs.append((cmd, subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                                stderr=subprocess.PIPE, text=True)))
        failures = []
        for cmd, proc in procs:
            _, err = proc.communicate(timeout=300)
            if proc.returncode != 0:
                failures.append(f"compile failed ({' '.join(cmd)}):\n{err[-4000:]}")
    except (OSError, subprocess.TimeoutExpired) as e:
        for _, proc in procs:
            proc.kill()
        raise BuildError(f"{cmds[0][0]} failed to run: {e}") from e
    if failures:
        raise BuildError(failures[0])


def _compile(compiler: str, isa: str, openmp: str | None, target: Path) -> None:
    """Build into a private temp dir next to ``target`` and rename into place atomically:
    two processes starting at once both build, and either result is complete."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        objects = [str(Path(tmp) / (name + ".o")) for name in SOURCES]
        _run_all([[compiler, *COMMON_FLAGS, *ISA_FLAGS[isa], *extra, "-c",
                   str(SOURCE_DIR / name), "-o", obj]
                  for (name, extra), obj in zip(SOURCES.items(), objects)])
        out = Path(tmp) / target.name
        # Link to the OpenMP runtime torch loaded; its soname makes the loader reuse it.
        runtime = [openmp] if openmp else ["-fopenmp"]
        _run_all([[compiler, "-shared", *objects, *runtime, "-o", str(out)]])
        os.replace(out, target)


def _prune(target: Path) -> None:
    """Keep the newest ``KEEP_BUILDS`` libraries of this ISA: every source edit adds one.
    Deleting a library another process has loaded is safe (its mapping outlives the name)."""
    isa_prefix = target.name.rsplit("-", 1)[0]
    builds = sorted(target.parent.glob(f"{isa_prefix}-*.so"), key=lambda p: p.stat().st_mtime,
                    reverse=True)
    for old in builds[KEEP_BUILDS:]:
        old.unlink(missing_ok=True)


def build_library(isa: str, root: Path) -> BuiltLibrary:
    """Load the kernels library for ``isa`` from the cache under ``root``, building it first if
    needed. Raises ``BuildError`` when there is no compiler, the build fails or it won't load."""
    if isa not in ISA_FLAGS:
        raise BuildError(f"unknown ISA {isa!r}")
    start = time.perf_counter()
    compiler, compiler_id = _compiler_identity(COMPILER)
    runtimes = loaded_openmp_runtimes()
    openmp = runtimes[0] if runtimes else None
    target = root / "kernels" / f"cpu-{isa}-{cache_key(isa, compiler_id, openmp or '')}.so"
    cache_hit = target.exists()
    if not cache_hit:
        _compile(compiler, isa, openmp, target)
        _prune(target)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        raise BuildError(f"cannot load {target}: {e}") from e
    after = loaded_openmp_runtimes()
    if len(after) > 1:
        logger.warning("several OpenMP runtimes are loaded (%s): their thread pools compete "
                       "for the cores", ", ".join(after))
    return BuiltLibrary(lib, target, cache_hit, time.perf_counter() - start)
