"""Issue 37's findings replayed against a real server (benchmarks/reliability_attacks.py) on a
tiny model: every check holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_every_finding_holds(tiny_llama, tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "reliability_attacks.py"), "--model",
         tiny_llama, "--out", str(tmp_path), "--server_args", "--dtype float32 --num_threads 1"],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    results = json.loads((tmp_path / "results.json").read_text())
    failed = {k: v for k, v in results.items() if isinstance(v, dict) and v.get("ok") is False}
    assert proc.returncode == 0 and results["all_ok"], (failed, proc.stdout[-3000:])
    assert results["exit"] == {"code": 0, "tracebacks_in_log": 0}, results["exit"]
