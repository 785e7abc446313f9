"""The package's layering: the import-linter contracts of pyproject.toml ([tool.importlinter]),
run as written (layers top to bottom, core/ without torch, checkpoint/ torch-free, the API
process's modules without model/, no cycles inside a package)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())"


def _contract_ids() -> set[str]:
    with open(REPO / "pyproject.toml", "rb") as f:
        return {c["id"] for c in tomllib.load(f)["tool"]["importlinter"]["contracts"]}


def test_the_contracts_cover_the_layering():
    assert {"layers", "core-no-torch", "core-nothing-above", "checkpoint-torch-free",
            "api-process-no-model", "acyclic"} <= _contract_ids()


def test_import_contracts_hold():
    # This checkout's bladellm, whatever is installed; no cache files left in the tree.
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", LINT_IMPORTS, "--no-cache",
                           str(REPO / "pyproject.toml")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
