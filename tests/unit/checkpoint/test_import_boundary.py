"""The API process finds and describes the model through ``bladellm.checkpoint`` and never
imports ``bladellm.model`` (the nn.Module world, torch); ``bladellm.checkpoint`` itself imports
no torch. Each check runs in a fresh interpreter: this test process has imported everything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def _modules_after(imports: str) -> set[str]:
    script = imports + textwrap.dedent("""
        import json, sys
        print(json.dumps(sorted(sys.modules)))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": REPO}, timeout=300)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.splitlines()[-1]))


def _model_modules(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m == "bladellm.model" or m.startswith("bladellm.model."))


def test_checkpoint_package_imports_neither_torch_nor_model():
    modules = _modules_after(textwrap.dedent("""
        import importlib, pkgutil
        import bladellm.checkpoint as pkg
        for info in pkgutil.iter_modules(pkg.__path__):
            importlib.import_module(f"bladellm.checkpoint.{info.name}")
    """))
    assert {"bladellm.checkpoint.locate", "bladellm.checkpoint.gguf",
            "bladellm.checkpoint.hub"} <= modules
    assert "torch" not in modules
    assert _model_modules(modules) == []


def test_api_process_modules_import_no_model_package():
    modules = _modules_after(textwrap.dedent("""
        import bladellm.entrypoints.api_server
        import bladellm.engine.async_llm
        import bladellm.engine.model_info
    """))
    assert "bladellm.checkpoint.locate" in modules  # the model is located through checkpoint/
    assert _model_modules(modules) == []
