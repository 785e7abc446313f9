"""Which format a checkpoint is in: ``config.json``'s ``quantization_config.quant_method``,
checked against ``--quantization`` (auto = whatever the checkpoint says)."""

from __future__ import annotations

from typing import Any

from bladellm.quantization.awq import AWQConfig
from bladellm.quantization.base import QuantConfig
from bladellm.quantization.compressed_tensors import CompressedTensorsConfig
from bladellm.quantization.gptq import GPTQConfig

FORMATS: dict[str, type[QuantConfig]] = {
    "gptq": GPTQConfig,
    "awq": AWQConfig,
    "compressed-tensors": CompressedTensorsConfig,
}
QUANTIZATION_CHOICES = ("auto", *FORMATS)


def raw_quantization_config(hf_config: Any) -> dict[str, Any] | None:
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None:
        return None
    if not isinstance(raw, dict):  # transformers may hold it as an object
        to_dict = getattr(raw, "to_dict", None)
        raw = to_dict() if to_dict is not None else vars(raw)
    return dict(raw)


def get_quant_config(hf_config: Any, quantization: str = "auto") -> QuantConfig | None:
    """The checkpoint's validated quantization config, or None for a float checkpoint."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"--quantization: must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                         f"got {quantization!r}")
    raw = raw_quantization_config(hf_config)
    if raw is None:
        if quantization != "auto":
            raise ValueError(f"--quantization {quantization}: the checkpoint's config.json has "
                             f"no quantization_config (it is not quantized)")
        return None
    method = str(raw.get("quant_method", "")).lower().replace("_", "-")
    if method not in FORMATS:
        raise ValueError(f"quantization_config.quant_method: {raw.get('quant_method')!r} is not "
                         f"supported (supported: {', '.join(FORMATS)})")
    if quantization not in ("auto", method):
        raise ValueError(f"--quantization {quantization}: the checkpoint is quantized with "
                         f"{method} (config.json quantization_config.quant_method)")
    return FORMATS[method].from_config(raw)
