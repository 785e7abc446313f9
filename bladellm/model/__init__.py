"""Model code: layers/, models/ (one file per architecture), registry.py (HF architecture ->
class), loader.py (dtype, quantization config, weights of a model ``bladellm.checkpoint``
located), parallel_fit.py (whether it splits into the TP / PP degrees). See docs/models.md."""
