"""``blade_llm_quantize``'s handling of bad paths and inputs: each is a ``ValueError`` naming
the flag (exit status 2) and leaves nothing behind; the source model is never touched."""

from __future__ import annotations

import os
import shutil

import pytest

from bladellm.entrypoints.cli.quantize import main, run


def _args(model: str, out: str, *extra: str) -> list[str]:
    return ["--model", model, "--output_dir", out, *extra]


def test_output_dir_symlink_to_model_is_refused(tiny_llama, tmp_path):
    """A link to the model is the model: with --overwrite the old code deleted the source's
    safetensors before failing."""
    src = tmp_path / "src"
    shutil.copytree(tiny_llama, src)
    link = tmp_path / "link"
    link.symlink_to(src)
    with pytest.raises(ValueError, match="--output_dir must differ from --model"):
        run(_args(str(src), str(link), "--overwrite"))
    assert (src / "model.safetensors").is_file()


def test_output_dir_tilde_is_expanded(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert main(_args(tiny_llama, "~/q")) == 0
    assert (tmp_path / "home" / "q" / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "~").exists()


def test_uncreatable_output_dir_names_the_flag(tiny_llama, tmp_path, capsys):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    assert main(_args(tiny_llama, str(a_file / "sub"))) == 2
    err = capsys.readouterr().err
    assert "--output_dir" in err and "Traceback" not in err


def test_failed_run_leaves_no_output_dir(tiny_llama, tmp_path, monkeypatch):
    """A failure after the output directory was made removes what this run created (up to the
    first directory that did not exist), so a retry needs no --overwrite."""
    from bladellm.quantization.algorithms import pipeline

    def boom(*_a, **_k):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(pipeline, "_write_config", boom)
    out = tmp_path / "new" / "q"
    with pytest.raises(RuntimeError, match="interrupted"):
        run(_args(tiny_llama, str(out)))
    assert not (tmp_path / "new").exists()
    # an existing empty --output_dir stays, emptied of what the run wrote
    out.mkdir(parents=True)
    with pytest.raises(RuntimeError, match="interrupted"):
        run(_args(tiny_llama, str(out)))
    assert out.is_dir() and os.listdir(out) == []


def _copy_with_config(src: str, dst, **changes) -> str:
    import json

    shutil.copytree(src, dst)
    with open(dst / "config.json") as f:
        config = json.load(f)
    config.update(changes)
    with open(dst / "config.json", "w") as f:
        json.dump(config, f)
    return str(dst)


def test_unsupported_architecture_refused_before_any_work(tiny_llama, tmp_path, capsys):
    """A GPT-2 (no model.layers.*) was a StopIteration traceback; a Mixtral failed at its
    first layer, leaving an empty --output_dir. Mixtral is supported now: a Llama checkpoint
    labelled Mixtral names no experts, which is said before any work."""
    for arch, says in (("GPT2LMHeadModel", "--model: architecture GPT2LMHeadModel"),
                       ("MixtralForCausalLM", "names no experts")):
        src = _copy_with_config(tiny_llama, tmp_path / arch, architectures=[arch])
        assert main(_args(src, str(tmp_path / f"{arch}-q"))) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, err
        assert not (tmp_path / f"{arch}-q").exists()


def test_quantized_weights_without_quantization_config_refused(tiny_llama, tmp_path, capsys):
    """An AutoGPTQ-style checkpoint (quantize_config.json, packed tensors, no
    quantization_config in config.json) was 'quantized' from randomly initialized weights
    (transformers initializes what the checkpoint lacks) with exit status 0."""
    import json

    gptq = tmp_path / "gptq"
    assert main(_args(tiny_llama, str(gptq), "--bit", "4", "--group_size", "32")) == 0
    with open(gptq / "config.json") as f:
        config = json.load(f)
    del config["quantization_config"]
    with open(gptq / "config.json", "w") as f:
        json.dump(config, f)
    assert main(_args(str(gptq), str(tmp_path / "again"))) == 2
    assert "already quantized (quantize_config.json)" in capsys.readouterr().err
    os.remove(gptq / "quantize_config.json")
    assert main(_args(str(gptq), str(tmp_path / "again"))) == 2
    assert "already quantized (model.layers.0." in capsys.readouterr().err
    assert not (tmp_path / "again").exists()


def test_missing_layer_tensors_refused(tiny_llama, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(tiny_llama, src)
    state = load_file(src / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    assert main(_args(str(src), str(tmp_path / "q"))) == 2
    err = capsys.readouterr().err
    assert "--model:" in err and "model.layers.1.mlp.up_proj.weight" in err, err


@pytest.mark.parametrize("extra,flag", [
    # given at their default values, these were accepted and ignored
    (["--num_calib_samples", "128"], "--num_calib_samples"),
    (["--calib_data_max_len", "512"], "--calib_data_max_len"),
    (["--quant_algo", "awq", "--damp_percent", "0.01", "--calib_data", "x y"], "--damp_percent"),
    # the error names the flag that was typed
    (["--quant_algo", "smoothquant", "--no-sym", "--calib_data", "x y"], "--no-sym"),
    (["--quant_algo", "smoothquant", "--block_wise_quant", "--calib_data", "x y"],
     "--block_wise_quant"),
])
def test_unused_flag_refused_even_at_its_default(extra, flag, tiny_llama, tmp_path):
    with pytest.raises(ValueError, match=flag):
        run(_args(tiny_llama, str(tmp_path / "q"), *extra))
    assert not (tmp_path / "q").exists()


def test_calib_data_errors_name_the_flag(tmp_path):
    from bladellm.quantization.calib import load_calibration_texts

    with pytest.raises(ValueError, match=r"--calib_data: .* is a directory"):
        load_calibration_texts(str(tmp_path))  # was "file ... not found"
    binary = tmp_path / "calib.txt"
    binary.write_bytes(bytes(range(128, 256)) * 4)
    with pytest.raises(ValueError, match=r"--calib_data: .*calib.txt is not UTF-8 text"):
        load_calibration_texts(str(binary))  # was codec's message, no flag


def test_missing_tokenizer_names_model(tiny_llama, calib_file, tmp_path, capsys):
    """Calibrated algorithms tokenize --calib_data with the model's tokenizer: read before the
    model, its absence is one line naming --model (was transformers' multi-line message)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(tiny_llama, name), src / name)
    rc = main(_args(str(src), str(tmp_path / "q"), "--quant_algo", "gptq",
                    "--calib_data", calib_file))
    err = capsys.readouterr().err
    assert rc == 2 and "--model: cannot load the tokenizer" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "q").exists()


def test_fewer_calibration_samples_than_asked_is_logged(tiny_llama, tmp_path, caplog):
    with caplog.at_level("WARNING", logger="bladellm.quantize"):
        assert main(_args(tiny_llama, str(tmp_path / "q"), "--quant_algo", "gptq",
                          "--calib_data", "The quick brown fox jumps over the lazy dog.",
                          "--num_calib_samples", "8", "--calib_data_max_len", "64")) == 0
    assert "1 calibration sample(s) of the 8 asked for" in caplog.text


def test_overwrite_removes_the_previous_gptq_config(tiny_llama, tmp_path):
    """A W8A8 run over a GPTQ one kept the GPTQ quantize_config.json (what AutoGPTQ reads)
    next to the compressed-tensors checkpoint."""
    out = str(tmp_path / "q")
    assert main(_args(tiny_llama, out, "--bit", "4", "--group_size", "32")) == 0
    assert os.path.isfile(os.path.join(out, "quantize_config.json"))
    assert main(_args(tiny_llama, out, "--quant_algo", "smoothquant", "--calib_data", "a b c d",
                      "--overwrite")) == 0
    assert not os.path.exists(os.path.join(out, "quantize_config.json"))
