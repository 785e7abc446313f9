"""Loader: checkpoint formats and the errors a user sees for a bad model directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from bladellm.attention import get_attn_backend
from bladellm.checkpoint.hf_config import load_hf_config
from bladellm.config import ModelConfig
from bladellm.kernels import resolve_kernels
from bladellm.kernels.scope import building_with
from bladellm.model.loader import build_model, find_weight_files, load_model, resolve_dtype
from bladellm.model.registry import get_model_class, supported_architectures
from bladellm.platforms.cpu import CpuInfo


# What a CPU worker resolves for --kernels auto and hands its model (one shared build).
KERNELS = resolve_kernels("auto", "cpu")


def load(model_dir, **model_kwargs):
    cfg = load_hf_config(str(model_dir), trust_remote_code=False)
    with building_with(KERNELS):
        return load_model(ModelConfig(model=str(model_dir), **model_kwargs), cfg, torch.float32,
                          "cpu", get_attn_backend(None, KERNELS))


def copy_model(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def llama_dir(tiny_model_factory):
    return tiny_model_factory("llama")


def test_unknown_architecture_lists_supported(llama_dir, tmp_path):
    d = copy_model(llama_dir, tmp_path / "m")
    edit_config(d, architectures=["FooForCausalLM"])
    cfg = load_hf_config(str(d), trust_remote_code=False)
    with pytest.raises(ValueError, match="FooForCausalLM") as e:
        get_model_class(cfg)
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM"):
        assert arch in str(e.value) and arch in supported_architectures()


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_hf_config(str(tmp_path / "nope"), trust_remote_code=False)
    with pytest.raises(ValueError, match="config.json"):
        load_hf_config(str(tmp_path), trust_remote_code=False)


def test_remote_code_needs_flag(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "my_custom_lm", "architectures": ["MyCustomLM"],
        "auto_map": {"AutoConfig": "configuration_my.MyConfig"}}))
    with pytest.raises(ValueError, match="--trust_remote_code"):
        load_hf_config(str(tmp_path), trust_remote_code=False)


def test_auto_map_on_a_known_model_type_needs_no_flag(llama_dir, tmp_path):
    d = copy_model(llama_dir, tmp_path / "m")
    edit_config(d, auto_map={"AutoConfig": "configuration_llama.LlamaConfig"})
    assert load_hf_config(str(d), trust_remote_code=False).model_type == "llama"


def test_shape_mismatch_names_parameter_file_and_shapes(llama_dir, tmp_path):
    d = copy_model(llama_dir, tmp_path / "m")
    edit_config(d, intermediate_size=96)  # checkpoint has 128
    with pytest.raises(ValueError) as e:
        load(d)
    msg = str(e.value)  # tensors stream in file order: down_proj comes first
    assert "model.safetensors" in msg and "parameter 'model.layers.0.mlp.down_proj.weight'" in msg
    assert "(64, 128)" in msg and "(64, 96)" in msg


def test_missing_tensor_is_named(llama_dir, tmp_path):
    d = copy_model(llama_dir, tmp_path / "m")
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.1.post_attention_layernorm.weight"]
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing 2") as e:
        load(d)
    assert "model.layers.1.post_attention_layernorm.weight" in str(e.value)
    assert "model.layers.0.self_attn.qkv_proj.weight" in str(e.value)


def test_sharded_safetensors_and_bin_fallback(llama_dir, tmp_path):
    reference = load(llama_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    config_files = ["config.json", "generation_config.json"]

    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(find_weight_files(str(sharded))) > 1
    assert same_weights(load(sharded), reference)

    bins = tmp_path / "bin"
    bins.mkdir()
    for name in config_files:
        shutil.copy(Path(llama_dir) / name, bins / name)
    torch.save(hf.state_dict(), bins / "pytorch_model.bin")
    assert find_weight_files(str(bins)) == [str(bins / "pytorch_model.bin")]
    assert same_weights(load(bins), reference)
    with pytest.raises(ValueError, match=r"\*\.safetensors"):
        find_weight_files(str(bins), "safetensors")


def test_missing_weight_files_are_named(llama_dir, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(Path(llama_dir) / "config.json", d / "config.json")
    with pytest.raises(ValueError, match="no weight files"):
        load(d)
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors"):
        load(d)


def test_dummy_weights(llama_dir, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(Path(llama_dir) / "config.json", d / "config.json")  # no weights needed
    model = load(d, load_format="dummy")
    w = model.model.layers[0].mlp.gate_up_proj.weight
    assert 0.01 < w.std().item() < 0.03
    assert torch.all(model.model.norm.weight == 1)
    assert same_weights(model, load(d, load_format="dummy"))  # seeded


def test_sliding_window_smaller_than_context_runs_with_the_window(tiny_model_factory):
    """Sliding windows are implemented (they used to be refused): each layer carries its
    window; one at least as long as the context is plain attention."""
    d = tiny_model_factory("mistral", sliding_window=64)  # max_position_embeddings=512
    model = load(d)
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [64, 64]
    full = load(tiny_model_factory("mistral", sliding_window=512))
    assert full.model.layers[0].self_attn.attn.sliding_window is None


def test_resolve_dtype(llama_dir):
    cfg = load_hf_config(llama_dir, trust_remote_code=False)
    # auto is bf16 only on a CPU with native bf16, whatever the checkpoint's dtype (faked CPUs:
    # the test must not depend on the machine it runs on; tests/unit/platforms covers the
    # other flag sets).
    native = CpuInfo("fake", frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl",
                                        "avx512_bf16"}), 2)
    avx2 = CpuInfo("fake", frozenset({"avx2", "fma"}), 2)
    assert resolve_dtype(cfg, "auto", cpu=avx2) == torch.float32  # saved from a float32 model
    assert resolve_dtype(cfg, "auto", cpu=native) == torch.bfloat16
    assert resolve_dtype(cfg, "bfloat16") == torch.bfloat16
    cfg.dtype = torch.bfloat16
    assert resolve_dtype(cfg, "auto", cpu=native) == torch.bfloat16
    assert resolve_dtype(cfg, "auto", cpu=avx2) == torch.float32
    assert resolve_dtype(cfg, "float16") == torch.float16  # allowed, with a warning on CPU


def test_build_model_kv_spec(tiny_model_factory):
    cfg = load_hf_config(tiny_model_factory("qwen3"), trust_remote_code=False)
    with building_with(KERNELS):
        model = build_model(cfg, torch.float32, "cpu", get_attn_backend("torch", KERNELS))
    spec = model.get_kv_cache_spec()
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (2, 2, 128)
    assert model.num_layers == 2


def test_tied_checkpoint_that_also_stores_lm_head(tiny_model_factory, tmp_path):
    d = copy_model(tiny_model_factory("llama", tie_word_embeddings=True), tmp_path / "m")
    tensors = load_file(str(d / "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = torch.zeros_like(embed)  # must be ignored, not loaded
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    model = load(d)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, embed)


def test_unknown_model_type_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_model"}))
    with pytest.raises(ValueError, match="cannot load .*config.json"):
        load_hf_config(str(tmp_path), trust_remote_code=False)
