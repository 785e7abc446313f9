from __future__ import annotations

import torch

from bladellm.quantization.algorithms.config import QuantizeConfig
from bladellm.quantization.algorithms.layer_io import LINEAR_NAMES
from bladellm.quantization.algorithms.pipeline import make_algorithm, quantize_checkpoint

from .reference import dequantize_gptq, dequantize_int8, read_checkpoint


class Recording:
    """Wraps an algorithm and keeps what it returned for each layer."""

    def __init__(self, inner) -> None:
        self.inner, self.name = inner, inner.name
        self.needs_calibration = inner.needs_calibration
        self.results: list[dict] = []

    def quantize_layer(self, layer, inputs):
        result = self.inner.quantize_layer(layer, inputs)
        self.results.append(result)
        return result


def quantize(model: str, out: str, algo: str, calib: str | None, *, algorithm=None,
             **kw) -> tuple[QuantizeConfig, Recording]:
    if algo != "minmax":  # minmax refuses calibration flags
        kw.setdefault("calib_data_max_len", 32)
        kw.setdefault("num_calib_samples", 6)
    if algo == "smoothquant":
        kw.setdefault("bit", 8)
        kw.setdefault("group_size", -1)
    else:
        kw.setdefault("group_size", 32)
    cfg = QuantizeConfig(model=model, output_dir=out, quant_algo=algo,
                         calib_data=None if algo == "minmax" else calib, **kw)
    rec = Recording(algorithm or make_algorithm(cfg))
    quantize_checkpoint(cfg, progress=False, algorithm=rec)
    return cfg, rec


@torch.no_grad()
def fake_quant_model(src: str, qdir: str, w8a8: bool = False):
    """The float model with every quantized linear replaced by its dequantized weight read back
    from ``qdir`` (and the other tensors, e.g. smoothed norms, taken from ``qdir`` too)."""
    import transformers

    from bladellm.quantization.algorithms.quantizer import fake_quantize_act_per_token

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    t = read_checkpoint(qdir)
    state = {}
    for i in range(model.config.num_hidden_layers):
        for n in LINEAR_NAMES:
            prefix = f"model.layers.{i}.{n}"
            state[prefix + ".weight"] = dequantize_int8(t, prefix) if w8a8 else \
                dequantize_gptq(t, prefix, _bits(t, prefix))
    for k, v in t.items():
        if k not in state and not k.endswith(_PACKED):
            state[k] = v.float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    if w8a8:
        for i in range(model.config.num_hidden_layers):
            for n in LINEAR_NAMES:
                model.model.layers[i].get_submodule(n).register_forward_pre_hook(
                    lambda _m, a: (fake_quantize_act_per_token(a[0]),))
    return model.eval()


_PACKED = (".qweight", ".qzeros", ".scales", ".g_idx", ".weight_scale")


def _bits(t: dict[str, torch.Tensor], prefix: str) -> int:
    in_features = t[prefix + ".g_idx"].numel()
    return 32 * t[prefix + ".qweight"].shape[0] // in_features


@torch.no_grad()
def hidden_error(ref_model, model, samples: list[torch.Tensor]) -> float:
    """Mean squared error of the model's last hidden state (after the final norm)."""
    err, n = 0.0, 0
    for ids in samples:
        a = ref_model.model(input_ids=ids).last_hidden_state
        b = model.model(input_ids=ids).last_hidden_state
        err += float((a - b).pow(2).sum())
        n += a.numel()
    return err / n
