"""The package's layering: the import-linter contracts of pyproject.toml ([tool.importlinter]).

The contracts are written as the layering should be. What does not hold yet is listed below,
each entry with the change that removes it; the contracts run with exactly those relaxations,
so everything else is enforced now, and a relaxation whose import has gone fails the run
(import-linter reports an ignored import that matches nothing), so the lists only shrink.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())"

# Imports that break a contract until the issue-29 branch named lands: contract id -> import
# expression -> whose change removes it.
KNOWN_BREAKS: dict[str, dict[str, str]] = {
    "layers": {
        "bladellm.core.scheduler -> bladellm.guided.grammar":
            "the scheduler builds two grammar error messages with guided.grammar helpers "
            "(unsatisfiable_error, failed_mid_output_error); they move below core/ (errors.py or "
            "the error-kind enum of item 6, one-shape-per-datum branch)",
    },
    "core-nothing-above": {
        "bladellm.core.scheduler -> bladellm.guided.grammar": "as in layers, above",
    },
    "acyclic": {
        "bladellm.quantization.writer -> bladellm.quantization.algorithms.quantizer":
            "writer and algorithms.pipeline import each other (not in issue 29's scope: for the "
            "quantization tool's owner)",
    },
}
# Packages that other issue-29 branches create; until they exist the contracts run as if they
# were not named (a layer of them is optional, a forbidden list drops them, a contract about
# them alone is not run).
NOT_YET: dict[str, str] = {
}


def _contracts() -> list[dict]:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["importlinter"]["contracts"]


def _as_checked_now(contract: dict) -> dict | None:
    """``contract`` with this branch's relaxations; None where it is about absent modules."""
    c = dict(contract)
    if c["type"] == "layers":
        c["layers"] = [" | ".join(f"({m})" if m in NOT_YET else m
                                  for m in (x.strip() for x in layer.split("|")))
                       for layer in c["layers"]]
    for key in ("source_modules", "forbidden_modules"):
        if key in c:
            c[key] = [m for m in c[key] if m not in NOT_YET]
            if not c[key]:
                return None
    known = KNOWN_BREAKS.get(c["id"], {})
    if known:
        c["ignore_imports"] = list(c.get("ignore_imports", [])) + list(known)
    return c


def _toml(config: dict, contracts: list[dict]) -> str:
    """TOML for import-linter (strings, lists of strings and booleans: JSON spells them alike)."""
    lines = ["[tool.importlinter]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in config.items() if k != "contracts"]
    for c in contracts:
        lines += ["", "[[tool.importlinter.contracts]]"]
        lines += [f"{k} = {json.dumps(v)}" for k, v in c.items()]
    return "\n".join(lines) + "\n"


def test_known_breaks_name_existing_contracts():
    ids = {c["id"] for c in _contracts()}
    assert set(KNOWN_BREAKS) <= ids


def test_import_contracts_hold(tmp_path):
    with open(REPO / "pyproject.toml", "rb") as f:
        config = tomllib.load(f)["tool"]["importlinter"]
    checked = [c for c in map(_as_checked_now, config["contracts"]) if c is not None]
    path = tmp_path / "importlinter.toml"
    path.write_text(_toml(config, checked))
    # This checkout's bladellm, whatever is installed; no cache files left in the tree.
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", LINT_IMPORTS, "--no-cache", str(path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]


@pytest.mark.xfail(strict=True, reason="the issue-29 branches have not all landed: the contracts "
                                       "run relaxed by KNOWN_BREAKS and NOT_YET")
def test_contracts_run_as_written():
    """Passes (and must then lose this mark) once nothing is relaxed any more."""
    assert not KNOWN_BREAKS and not NOT_YET
