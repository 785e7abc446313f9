"""Quantization sits below the layers: ``bladellm.quantization`` (the serving formats, the
linear-method interface, the weight attributes, the offline algorithms) imports nothing from
``bladellm.model``, which imports it."""

import json
import subprocess
import sys

MODULES = ["bladellm.quantization", "bladellm.quantization.linear_method",
           "bladellm.quantization.weight_attrs", "bladellm.quantization.base",
           "bladellm.quantization.method", "bladellm.quantization.params",
           "bladellm.quantization.detect", "bladellm.quantization.cpu_kernels",
           "bladellm.quantization.gpu_kernels", "bladellm.quantization.algorithms.writer",
           "bladellm.quantization.calib", "bladellm.quantization.algorithms.pipeline",
           "bladellm.quantization.algorithms.model_source"]


def test_quantization_imports_nothing_from_model():
    script = ("import importlib, json, sys\n"
              f"for name in {MODULES!r}:\n"
              "    importlib.import_module(name)\n"
              "print(json.dumps(sorted(m for m in sys.modules if m == 'bladellm.model' "
              "or m.startswith('bladellm.model.'))))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_layers_import_the_interface_from_quantization():
    from bladellm.model.layers import linear
    from bladellm.quantization.linear_method import LinearMethodBase
    from bladellm.quantization.method import QuantLinearMethod

    assert issubclass(linear.UnquantizedLinearMethod, LinearMethodBase)
    assert issubclass(QuantLinearMethod, LinearMethodBase)
    assert linear.set_weight_attrs.__module__ == "bladellm.quantization.weight_attrs"
