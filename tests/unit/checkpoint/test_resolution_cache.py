"""checkpoint/resolution_cache.py: configs and tokenizer classes remembered across starts answer what
transformers answers, and a start that finds them skips transformers' heavy imports."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from bladellm.checkpoint import resolution_cache as rc
from bladellm.checkpoint.hf_config import load_hf_config

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


@pytest.fixture
def cache_dir(fresh_cache_dir):
    return fresh_cache_dir("BLADELLM_RESOLUTION_CACHE_DIR", "BLADELLM_RESOLUTION_CACHE")


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _attrs(config) -> dict:
    return rc._public_attributes(config)[0]


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 256}}),
    ("qwen2", {}),
    ("qwen3", {}),
])
def test_snapshot_answers_every_attribute_as_transformers(tiny_model_factory, tmp_path,
                                                          cache_dir, arch, overrides):
    from tiny_models import make_tiny_model

    model_dir = (make_tiny_model(tmp_path / "m", arch, **overrides) if overrides
                 else _copy(tiny_model_factory(arch), tmp_path / "m"))
    real = load_hf_config(model_dir, False, snapshot=True)  # first: transformers, recorded
    assert not isinstance(real, rc.ConfigSnapshot)
    assert len(list(cache_dir.glob("config-*.json"))) == 1
    snap = load_hf_config(model_dir, False, snapshot=True)
    assert isinstance(snap, rc.ConfigSnapshot)
    expected = _attrs(real)
    assert len(expected) > 40
    for name, value in expected.items():
        if name in snap._unrecorded:
            with pytest.raises(RuntimeError, match="not recorded"):
                getattr(snap, name, None)  # never a silent default
            continue
        got = getattr(snap, name)
        assert type(got) is type(value) and got == value, name
    assert snap.to_json_string() == real.to_json_string()
    assert snap.to_dict() == real.to_dict()
    assert getattr(snap, "no_such_attribute", "default") == "default"
    assert isinstance(snap.dtype, torch.dtype) or isinstance(snap.dtype, str)
    back = pickle.loads(pickle.dumps(snap))
    assert back.to_json_string() == snap.to_json_string() and back.hidden_size == real.hidden_size
    with pytest.raises(AttributeError, match="read-only"):
        snap.hidden_size = 1


def test_engine_gets_the_same_model_from_a_snapshot(tiny_model_factory, tmp_path, cache_dir):
    from bladellm.config import ModelConfig
    from bladellm.model.loader import resolve_model

    model_dir = _copy(tiny_model_factory("qwen3"), tmp_path / "m")
    first = resolve_model(ModelConfig(model=model_dir), snapshot_config=True)
    second = resolve_model(ModelConfig(model=model_dir), snapshot_config=True)
    assert isinstance(second.hf_config, rc.ConfigSnapshot)
    assert (second.dtype, second.max_model_len) == (first.dtype, first.max_model_len)
    # Callers that need a real config never get a snapshot.
    assert not isinstance(resolve_model(ModelConfig(model=model_dir)).hf_config,
                          rc.ConfigSnapshot)


def test_changed_bytes_remote_code_and_the_switch_bypass_the_cache(tiny_model_factory, tmp_path,
                                                                  cache_dir, monkeypatch):
    model_dir = _copy(tiny_model_factory("llama"), tmp_path / "m")
    load_hf_config(model_dir, False, snapshot=True)
    assert isinstance(load_hf_config(model_dir, False, snapshot=True), rc.ConfigSnapshot)
    path = os.path.join(model_dir, "config.json")
    cfg = json.load(open(path))
    cfg["rms_norm_eps"] = 1e-3
    json.dump(cfg, open(path, "w"))
    fresh = load_hf_config(model_dir, False, snapshot=True)  # new bytes: transformers again
    assert not isinstance(fresh, rc.ConfigSnapshot) and fresh.rms_norm_eps == 1e-3
    assert load_hf_config(model_dir, False, snapshot=True).rms_norm_eps == 1e-3
    assert not isinstance(load_hf_config(model_dir, True, snapshot=True), rc.ConfigSnapshot)
    monkeypatch.setenv("BLADELLM_RESOLUTION_CACHE", "0")
    assert not isinstance(load_hf_config(model_dir, False, snapshot=True), rc.ConfigSnapshot)
    monkeypatch.setenv("BLADELLM_RESOLUTION_CACHE", "maybe")
    with pytest.raises(ValueError, match="BLADELLM_RESOLUTION_CACHE"):
        load_hf_config(model_dir, False, snapshot=True)


def test_corrupt_entry_costs_only_the_slow_path(tiny_model_factory, tmp_path, cache_dir):
    model_dir = _copy(tiny_model_factory("llama"), tmp_path / "m")
    load_hf_config(model_dir, False, snapshot=True)
    (entry,) = cache_dir.glob("config-*.json")
    entry.write_text('{"format": 1, "config": {"attrs": 3}}')
    config = load_hf_config(model_dir, False, snapshot=True)
    assert config.hidden_size == 64
    entry.write_text("not json")
    assert load_hf_config(model_dir, False, snapshot=True).hidden_size == 64


def test_tokenizer_class_is_remembered_only_when_both_loads_agree(tiny_model_factory, tmp_path,
                                                                  cache_dir, monkeypatch):
    from transformers import AutoTokenizer

    model_dir = _copy(tiny_model_factory("llama"), tmp_path / "m")
    calls = []

    def auto():
        calls.append(1)
        return AutoTokenizer.from_pretrained(model_dir)

    first = rc.remembered_tokenizer(model_dir, False, auto)
    (entry,) = cache_dir.glob("tokenizer-*.json")
    assert json.loads(entry.read_text())["class"] == type(first).__name__

    def refuse():
        raise AssertionError("AutoTokenizer was asked again")

    second = rc.remembered_tokenizer(model_dir, False, refuse)
    assert type(second) is type(first)
    assert rc._tokenizer_facts(second) == rc._tokenizer_facts(first)
    assert second.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        first.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)

    # A directory where the direct load disagrees: AutoTokenizer every time, decided once.
    other = _copy(tiny_model_factory("llama"), tmp_path / "n")
    facts = rc._tokenizer_facts
    seen = []

    def disagreeing(tok):
        seen.append(1)
        return {**facts(tok), "n": len(seen)}

    monkeypatch.setattr(rc, "_tokenizer_facts", disagreeing)
    rc.remembered_tokenizer(other, False, lambda: AutoTokenizer.from_pretrained(other))
    entries = [json.loads(p.read_text()) for p in cache_dir.glob("tokenizer-*.json")]
    assert sorted(e["class"] is None for e in entries) == [False, True]
    calls.clear()
    rc.remembered_tokenizer(other, False, auto)
    assert calls == [1]


def test_warm_start_skips_transformers_config_and_auto_imports(tiny_model_factory, tmp_path,
                                                               cache_dir):
    """What the start-up gain rests on: with entries written, what the API process does to
    start (import the server and AsyncLLM, locate the model, load its tokenizer) imports
    neither transformers' config classes nor torch at all; importing the core client imports
    no torch even cold."""
    model_dir = _copy(tiny_model_factory("llama"), tmp_path / "m")
    script = textwrap.dedent(f"""
        import sys
        import bladellm.engine.core_client
        assert "torch" not in sys.modules, "core_client imports torch"
        import bladellm.entrypoints.api_server
        import bladellm.engine.async_llm
        from bladellm.config import ModelConfig
        from bladellm.engine.model_info import model_info_for
        from bladellm.checkpoint.locate import locate_model
        from bladellm.platforms.threads import configure_frontend_threads
        configure_frontend_threads()  # AsyncLLM's first step
        resolved = locate_model(ModelConfig(model={model_dir!r}), snapshot_config=True)
        info = model_info_for(resolved)
        print(type(resolved.hf_config).__name__, info.max_model_len,
              sorted(m for m in ("transformers.models.llama.configuration_llama",
                                 "transformers.models.auto.tokenization_auto", "torch")
                     if m in sys.modules))
    """)
    env = {**os.environ, "PYTHONPATH": REPO}
    run = lambda: subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,  # noqa: E731
                                 text=True, timeout=300)
    cold = run()
    assert cold.returncode == 0, cold.stderr
    assert cold.stdout.split()[0] == "LlamaConfig"
    warm = run()
    assert warm.returncode == 0, warm.stderr
    assert warm.stdout.split() == ["ConfigSnapshot", "512", "[]"], warm.stdout


@pytest.mark.parametrize("name", ["LlavaConfig", "Qwen2VLConfig", "Gemma3Config", "GPT2Config"])
def test_composite_and_aliased_configs_record_or_refuse_cleanly(name):
    """Composite configs (sub-configs, ``sub_configs`` naming classes) and ``attribute_map``
    aliases (GPT-2's n_embd for hidden_size): every recorded attribute answers as the config;
    what cannot be recorded raises on access instead of defaulting."""
    import transformers

    config = getattr(transformers, name)()
    record = rc._config_record(config)
    snap = rc._snapshot_from_record(json.loads(json.dumps(record)))
    attrs, _ = rc._public_attributes(config)
    for attr, value in attrs.items():
        if attr in snap._unrecorded:
            with pytest.raises(RuntimeError):
                getattr(snap, attr, None)
        else:
            assert rc._same(getattr(snap, attr), value), attr
    assert snap.hidden_size == config.hidden_size if hasattr(config, "hidden_size") else True
    assert snap.to_json_string() == config.to_json_string()
    assert snap.to_dict() == config.to_dict()


@pytest.mark.parametrize("content", ["[]", "null", '"x"', '{"format": 1, "class": 3}'])
def test_malformed_entries_fall_back(tiny_model_factory, tmp_path, cache_dir, content):
    from transformers import AutoTokenizer

    model_dir = _copy(tiny_model_factory("llama"), tmp_path / "m")
    load_hf_config(model_dir, False, snapshot=True)
    rc.remembered_tokenizer(model_dir, False, lambda: AutoTokenizer.from_pretrained(model_dir))
    for entry in cache_dir.glob("*.json"):
        entry.write_text(content)
    assert load_hf_config(model_dir, False, snapshot=True).hidden_size == 64
    tok = rc.remembered_tokenizer(model_dir, False,
                                  lambda: AutoTokenizer.from_pretrained(model_dir))
    assert tok.encode("hello")


def test_unreadable_config_is_still_a_clear_error(tmp_path, cache_dir):
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        load_hf_config(str(tmp_path), False, snapshot=True)
