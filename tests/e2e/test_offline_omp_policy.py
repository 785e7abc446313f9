"""The offline engine sets its OpenMP wait policy when it starts, not when ``bladellm`` is
imported: importing leaves the process's environment alone, and ``LLM(...)`` in a process that
has not loaded torch yet starts OpenMP with ``GOMP_SPINCOUNT=1000`` (docs/cpu.md)."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import os, sys
from bladellm import LLM
assert "torch" not in sys.modules, "importing the engine loaded torch"
assert "GOMP_SPINCOUNT" not in os.environ, "importing the engine set the OpenMP policy"
LLM(model=sys.argv[1], dtype="float32", kv_cache_memory="4MiB")
assert os.environ.get("GOMP_SPINCOUNT") == "1000"
"""


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_offline_engine_starts_openmp_with_the_short_spin(tiny_llama):
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    env["OMP_DISPLAY_ENV"] = "verbose"  # libgomp prints its settings when torch loads it
    proc = subprocess.run([sys.executable, "-c", SCRIPT, tiny_llama], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GOMP_SPINCOUNT = '1000'" in proc.stderr
