"""Each algorithm does what it is for, measured on the written checkpoint read back (hidden-state
error of the fake-quantized model against the float one on the calibration data)."""

from __future__ import annotations

import pytest
import torch
import transformers

from bladellm.quantization.algorithms.smoothquant import SmoothQuant
from bladellm.quantization.calib import load_calibration_texts, tokenize_calibration

from .helpers import fake_quant_model, hidden_error, quantize


def _error(model_dir: str, calib: str, qdir: str, w8a8: bool = False) -> float:
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    samples = tokenize_calibration(tok, load_calibration_texts(calib), 32, 6)
    return hidden_error(ref.eval(), fake_quant_model(model_dir, qdir, w8a8), samples)


@pytest.fixture(scope="module")
def minmax_error(outlier_llama, calib_file, tmp_path_factory):
    cfg, _ = quantize(outlier_llama, str(tmp_path_factory.mktemp("mm") / "q"), "minmax", None)
    return _error(outlier_llama, calib_file, cfg.output_dir)


@pytest.mark.parametrize("group_size", [32, -1])
def test_gptq_linear_objective(group_size):
    """On one linear with correlated inputs GPTQ's ||(W - Q) X|| is far below round to
    nearest's (its whole point), with and without act-order."""
    from bladellm.quantization.algorithms.gptq import HessianAccumulator, gptq_quantize
    from bladellm.quantization.algorithms.quantizer import GroupQuantSpec, rtn_quantize

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 128, generator=gen) @ (
        0.1 * torch.randn(128, 128, generator=gen) + torch.eye(128))
    x[:, :4] *= 20
    w = torch.randn(64, 128, generator=gen)
    acc = HessianAccumulator(128)
    for chunk in x.split(256):
        acc.add_batch(chunk.unsqueeze(0))
    spec = GroupQuantSpec(4, group_size, True)

    def err(q):
        return float(((w - q.dequantize()) @ x.t()).pow(2).mean())

    rtn = err(rtn_quantize(w, spec))
    assert err(gptq_quantize(w, acc.H, spec)) < 0.4 * rtn
    assert err(gptq_quantize(w, acc.H, spec, act_order=True)) < 0.4 * rtn


def test_gptq_beats_minmax(outlier_llama, calib_file, minmax_error, tmp_path):
    cfg, _ = quantize(outlier_llama, str(tmp_path / "q"), "gptq", calib_file)
    err = _error(outlier_llama, calib_file, cfg.output_dir)
    assert err < 0.9 * minmax_error, (err, minmax_error)


def test_gptq_act_order_beats_minmax(outlier_llama, calib_file, minmax_error, tmp_path):
    cfg, _ = quantize(outlier_llama, str(tmp_path / "q"), "gptq", calib_file, act_order=True)
    # outlier channels are where quantizing important columns first pays off
    assert _error(outlier_llama, calib_file, cfg.output_dir) < 0.6 * minmax_error


def test_awq_beats_minmax(outlier_llama, calib_file, minmax_error, tmp_path):
    cfg, rec = quantize(outlier_llama, str(tmp_path / "q"), "awq", calib_file)
    err = _error(outlier_llama, calib_file, cfg.output_dir)
    assert err < 0.8 * minmax_error, (err, minmax_error)
    assert any(r > 0 for r in rec.inner.chosen_ratios)  # scaling, not only clipping, was used


def test_smoothquant_plus_not_worse_than_minmax(outlier_llama, calib_file, minmax_error,
                                                tmp_path):
    cfg, rec = quantize(outlier_llama, str(tmp_path / "q"), "smoothquant+", calib_file)
    err = _error(outlier_llama, calib_file, cfg.output_dir)
    assert err <= minmax_error * 1.0001, (err, minmax_error)
    assert any(a is not None for a in rec.inner.chosen_alphas)


def test_smoothing_helps_w8a8_with_outliers(outlier_llama, calib_file, tmp_path):
    cfg, _ = quantize(outlier_llama, str(tmp_path / "sq"), "smoothquant", calib_file)
    smoothed = _error(outlier_llama, calib_file, cfg.output_dir, w8a8=True)
    cfg, _ = quantize(outlier_llama, str(tmp_path / "plain"), "smoothquant", calib_file,
                      algorithm=SmoothQuant(smoothing=False))
    plain = _error(outlier_llama, calib_file, cfg.output_dir, w8a8=True)
    assert smoothed < 0.5 * plain, (smoothed, plain)
