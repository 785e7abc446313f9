"""--cpu_offload gives the same checkpoint; the command line validates its flags."""

from __future__ import annotations

import json
import os

import pytest
import torch

from bladellm.entrypoints.cli.quantize import main, run
from bladellm.quantization.calib import load_calibration_texts, tokenize_calibration

from .helpers import quantize
from .reference import read_checkpoint


@pytest.mark.parametrize("algo,kw", [("gptq", {"act_order": True}), ("smoothquant", {}),
                                     ("awq", {})])
def test_cpu_offload_is_bit_identical(algo, kw, tiny_llama, calib_file, tmp_path):
    a, _ = quantize(tiny_llama, str(tmp_path / "a"), algo, calib_file, **kw)
    b, _ = quantize(tiny_llama, str(tmp_path / "b"), algo, calib_file, cpu_offload=True, **kw)
    ta, tb = read_checkpoint(a.output_dir), read_checkpoint(b.output_dir)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k
    with open(os.path.join(a.output_dir, "config.json")) as f:
        ca = json.load(f)
    with open(os.path.join(b.output_dir, "config.json")) as f:
        assert json.load(f) == ca


def test_cli_writes_checkpoint(tiny_llama, calib_file, tmp_path, capsys):
    out = tmp_path / "q"
    rc = main(["--model", tiny_llama, "--output-dir", str(out), "--quant_algo", "gptq",
               "--bit", "8", "--group_size", "-1", "--asym", "--calib_data", calib_file,
               "--num_calib_samples", "2", "--calib_data_max_len", "16"])
    assert rc == 0, capsys.readouterr().err
    with open(out / "config.json") as f:
        qc = json.load(f)["quantization_config"]
    assert (qc["bits"], qc["group_size"], qc["sym"]) == (8, -1, False)
    assert qc["meta"]["num_calib_samples"] == 2
    t = read_checkpoint(str(out))
    assert t["model.layers.0.mlp.down_proj.scales"].shape == (1, 64)
    # a second run needs --overwrite
    args = ["--model", tiny_llama, "--output_dir", str(out), "--quant_algo", "minmax",
            "--group_size", "32"]
    assert main(args) == 2
    assert "--output_dir" in capsys.readouterr().err
    assert main(args + ["--overwrite"]) == 0


def test_cli_product_defaults(tiny_llama, tmp_path):
    """The product's documented defaults: minmax, 8 bit, per channel, weight only; its
    --quant_mode and --block_wise_quant flags are accepted."""
    out = tmp_path / "q"
    assert main(["--model", tiny_llama, "--output_dir", str(out)]) == 0
    with open(out / "config.json") as f:
        qc = json.load(f)["quantization_config"]
    assert (qc["meta"]["quant_algo"], qc["bits"], qc["group_size"]) == ("minmax", 8, -1)
    out2 = tmp_path / "q2"
    assert main(["--model", tiny_llama, "--output_dir", str(out2), "--quant_mode",
                 "weight_only_quant", "--block_wise_quant", "--bit", "4"]) == 0
    with open(out2 / "config.json") as f:
        qc = json.load(f)["quantization_config"]
    assert (qc["bits"], qc["group_size"]) == (4, 64)


def _args(model: str, out: str, *extra: str) -> list[str]:
    return ["--model", model, "--output_dir", out, *extra]


@pytest.mark.parametrize("extra,flag", [
    (["--quant_algo", "smoothquant", "--bit", "4", "--calib_data", "x y"], "--bit"),
    (["--quant_algo", "smoothquant", "--group_size", "32", "--calib_data", "x y"],
     "--group_size"),
    (["--quant_algo", "gptq", "--group_size", "48", "--calib_data", "x y"], "--group_size 48"),
    (["--quant_algo", "gptq", "--calib_data", "/no/such/calib.txt"], "--calib_data"),
    (["--quant_algo", "gptq"], "--calib_data"),
    (["--quant_algo", "minmax", "--calib_data", "x y"], "--calib_data"),
    (["--quant_algo", "awq", "--act_order", "--calib_data", "x y"], "--act_order"),
    (["--quant_algo", "gptq", "--alpha", "0.5", "--calib_data", "x y"], "--alpha"),
    (["--quant_algo", "smoothquant", "--alpha", "1.5", "--calib_data", "x y"], "--alpha"),
    (["--quant_algo", "gptq", "--num_calib_samples", "0", "--calib_data", "x y"],
     "--num_calib_samples"),
    (["--quant_algo", "gptq", "--quant_mode", "act_and_weight_quant", "--calib_data", "x y"],
     "--quant_mode"),
    (["--block_wise_quant", "--group_size", "32"], "--block_wise_quant"),
])
def test_cli_errors_name_the_flag(extra, flag, tiny_llama, tmp_path):
    with pytest.raises(ValueError, match=flag):
        run(_args(tiny_llama, str(tmp_path / "q"), *extra))
    assert not (tmp_path / "q").exists()


def test_cli_model_dir_checks(tiny_llama, tmp_path, capsys):
    with pytest.raises(ValueError, match="--model"):
        run(_args(str(tmp_path / "missing"), str(tmp_path / "q"), "--quant_algo", "minmax"))
    with pytest.raises(ValueError, match="--output_dir must differ"):
        run(_args(tiny_llama, tiny_llama, "--quant_algo", "minmax"))
    quantized = tmp_path / "quantized"
    assert main(_args(tiny_llama, str(quantized), "--quant_algo", "minmax",
                      "--group_size", "32")) == 0
    assert main(_args(str(quantized), str(tmp_path / "again"), "--quant_algo", "minmax")) == 2
    assert "already quantized" in capsys.readouterr().err


def test_calibration_sources(tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text('{"text": "first doc"}\n\n{"text": "second doc"}\n')
    assert load_calibration_texts(str(jsonl)) == ["first doc", "second doc"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"content": "x"}\n')
    with pytest.raises(ValueError, match="--calib_data.*'text'"):
        load_calibration_texts(str(bad))
    paragraphs = tmp_path / "p.txt"
    paragraphs.write_text("a b\nc d\n\n\ne f\n")
    assert load_calibration_texts(str(paragraphs)) == ["a b\nc d", "e f"]
    lines = tmp_path / "l.txt"
    lines.write_text("one\ntwo\n")
    assert load_calibration_texts(str(lines)) == ["one", "two"]
    assert load_calibration_texts("just some text") == ["just some text"]
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    text = ["The quick brown fox jumps over the lazy dog."] * 20
    chunks = tokenize_calibration(tok, text, 16, 5)
    assert len(chunks) == 5 and all(c.shape == (1, 16) for c in chunks)
    stream = torch.cat([c[0] for c in chunks])
    assert int((stream == tok.eos_token_id).sum()) >= 1  # documents separated by EOS


def test_console_script_registered():
    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert scripts["blade_llm_quantize"] == "bladellm.entrypoints.cli.quantize:main"
