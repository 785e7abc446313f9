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
