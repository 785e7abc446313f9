"""The offline engine sets its OpenMP wait policy when it starts, not when ``bladellm`` is
imported: importing leaves the process's environment alone, and ``LLM(...)`` in a process that
has not loaded torch yet starts OpenMP with ``OMP_WAIT_POLICY=PASSIVE`` (docs/cpu.md)."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import os, sys
from bladellm import LLM
assert "torch" not in sys.modules, "importing the engine loaded torch"
assert "OMP_WAIT_POLICY" not in os.environ, "importing the engine set the OpenMP policy"
LLM(model=sys.argv[1], dtype="float32", kv_cache_memory="4MiB")
assert os.environ.get("OMP_WAIT_POLICY") == "PASSIVE"
"""


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_offline_engine_starts_openmp_with_the_passive_policy(tiny_llama):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["OMP_DISPLAY_ENV"] = "true"  # libgomp prints its settings when torch loads it
    proc = subprocess.run([sys.executable, "-c", SCRIPT, tiny_llama], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OMP_WAIT_POLICY = 'PASSIVE'" in proc.stderr
