"""Model code: layers/, models/ (one file per architecture), registry.py (HF architecture ->
class), loader.py (config, dtype, weights). See docs/models.md."""
