"""``--model org/name`` from a pre-populated hub cache, with no network: HF_HUB_OFFLINE,
--revision, --download_dir, the error when the model is not cached, ModelScope selection."""

import os
import shutil
import sys

import pytest
import torch

from bladellm.checkpoint.hub import is_model_id
from bladellm.config import ModelConfig
from bladellm.engine.model_info import model_info_for
from bladellm.model.loader import resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _populate(cache, model_dir: str, repo: str = "acme/tiny-llama", ref: str = "main",
              commit: str = COMMIT) -> str:
    """Lay out ``model_dir`` as huggingface_hub's cache does (refs/<ref> -> snapshots/<commit>)."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    return str(snapshot)


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_model_id_from_a_prepopulated_cache(tiny_llama, tmp_path, offline):
    snapshot = _populate(tmp_path, tiny_llama)
    cfg = ModelConfig(model="acme/tiny-llama", download_dir=str(tmp_path))
    resolved = resolve_model(cfg)
    assert resolved.path == snapshot
    info = model_info_for(resolved)
    assert info.served_model_name == "acme/tiny-llama"  # served under its id, as vLLM does
    assert info.tokenizer.encode("hello")


def test_revision_picks_the_snapshot(tiny_llama, tmp_path, offline):
    _populate(tmp_path, tiny_llama)
    other = "f" * 40
    snapshot = _populate(tmp_path, tiny_llama, ref="v2", commit=other)
    cfg = ModelConfig(model="acme/tiny-llama", download_dir=str(tmp_path), revision="v2")
    assert resolve_model(cfg).path == snapshot


def test_offline_and_not_cached_is_a_clear_error(tmp_path, offline):
    cfg = ModelConfig(model="acme/not-cached", download_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"--model acme/not-cached: not found in .* and "
                                         r"HF_HUB_OFFLINE is set"):
        resolve_model(cfg)


def test_local_directory_wins_over_an_id(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.makedirs("acme")
    shutil.copytree(tiny_llama, "acme/local")
    assert not is_model_id("acme/local") and is_model_id("acme/remote")
    assert not is_model_id("/abs/path") and not is_model_id("demo")
    assert resolve_model(ModelConfig(model="acme/local")).path == "acme/local"


def test_modelscope_needs_the_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "modelscope", None)  # as if not installed
    cfg = ModelConfig(model="acme/tiny", model_hub="modelscope")
    with pytest.raises(ValueError, match="pip install modelscope"):
        resolve_model(cfg)


def test_modelscope_is_used_when_selected(tiny_llama, tmp_path, monkeypatch):
    calls = []

    def snapshot_download(model_id, **kwargs):
        calls.append((model_id, kwargs))
        return tiny_llama

    monkeypatch.setitem(sys.modules, "modelscope",
                        type(sys)("modelscope"))
    sys.modules["modelscope"].snapshot_download = snapshot_download
    cfg = ModelConfig(model="acme/tiny", model_hub="modelscope", revision="v1",
                      download_dir=str(tmp_path))
    assert resolve_model(cfg).path == tiny_llama
    assert calls == [("acme/tiny", {"cache_dir": str(tmp_path), "revision": "v1"})]


def test_bad_hub_name():
    with pytest.raises(ValueError, match="--model_hub"):
        ModelConfig(model_hub="github")


@pytest.mark.parametrize("flag,value", [("revision", "v2"), ("download_dir", "/tmp/hub"),
                                        ("model_hub", "modelscope")])
@pytest.mark.parametrize("local", ["dir", "gguf", "demo"])
def test_hub_flags_refused_for_a_local_model(tiny_llama, tmp_path, flag, value, local):
    """They only say where a model id comes from: with a local --model they would be ignored."""
    model = {"dir": tiny_llama, "gguf": str(tmp_path / "m.gguf"), "demo": "demo"}[local]
    with pytest.raises(ValueError, match=rf"^--{flag} {value}: only applies when --model is a "
                                         rf"hub model id"):
        resolve_model(ModelConfig(model=model, **{flag: value}))


def _fake_modelscope(monkeypatch, paths: dict[str, str]) -> list:
    calls = []

    def snapshot_download(model_id, **kwargs):
        calls.append((model_id, kwargs))
        return paths[model_id]

    monkeypatch.setitem(sys.modules, "modelscope", type(sys)("modelscope"))
    sys.modules["modelscope"].snapshot_download = snapshot_download
    return calls


def test_draft_id_comes_from_the_same_hub(tiny_llama, tmp_path, monkeypatch):
    """--model_hub and --download_dir apply to a --draft.model id too; --revision is --model's."""
    from bladellm.config import EngineConfig
    from bladellm.spec_decode.draft_model import draft_model_config

    calls = _fake_modelscope(monkeypatch, {"acme/draft": tiny_llama})
    cfg = EngineConfig.from_kwargs(model="acme/target", model_hub="modelscope", revision="v1",
                                   download_dir=str(tmp_path), decode_algo="sps",
                                   draft_model="acme/draft")
    draft = draft_model_config(cfg, 128, torch.float32)
    assert (draft.model_hub, draft.download_dir, draft.revision) == (
        "modelscope", str(tmp_path), None)
    assert resolve_model(draft).path == tiny_llama
    assert calls == [("acme/draft", {"cache_dir": str(tmp_path)})]
    # A local draft keeps the defaults (they would be refused on a local path).
    local = EngineConfig.from_kwargs(model="acme/target", model_hub="modelscope",
                                     decode_algo="sps", draft_model=tiny_llama)
    assert resolve_model(draft_model_config(local, 128, torch.float32)).path == tiny_llama


def test_draft_dtype_auto_is_the_targets(tiny_llama):
    """--draft.dtype auto proposes in the target's resolved dtype; an explicit value wins."""
    from bladellm.config import EngineConfig
    from bladellm.spec_decode.draft_model import draft_model_config

    cfg = EngineConfig.from_kwargs(model=tiny_llama, decode_algo="sps", draft_model=tiny_llama)
    assert draft_model_config(cfg, 128, torch.bfloat16).dtype == "bfloat16"
    assert draft_model_config(cfg, 128, torch.float32).dtype == "float32"
    explicit = EngineConfig.from_kwargs(model=tiny_llama, decode_algo="sps",
                                        draft_model=tiny_llama, draft_dtype="float32")
    assert draft_model_config(explicit, 128, torch.bfloat16).dtype == "float32"


def test_api_process_hands_the_core_local_paths(tiny_llama, tmp_path, monkeypatch):
    """The core gets the fetched directories of --model and --draft.model, without the hub flags
    (spent on the fetch, refused on a local path)."""
    from bladellm.config import EngineConfig
    from bladellm.engine.async_llm import _local_model_config
    from bladellm.checkpoint.locate import locate_model

    draft_dir = str(tmp_path / "draft")
    shutil.copytree(tiny_llama, draft_dir)
    calls = _fake_modelscope(monkeypatch, {"acme/target": tiny_llama, "acme/draft": draft_dir})
    cfg = EngineConfig.from_kwargs(model="acme/target", model_hub="modelscope", revision="v1",
                                   download_dir=str(tmp_path), decode_algo="sps",
                                   draft_model="acme/draft")
    core = _local_model_config(cfg, locate_model(cfg.model))
    assert (core.model.model, core.draft.model) == (tiny_llama, draft_dir)
    assert (core.model.revision, core.model.download_dir, core.model.model_hub) == (
        None, None, "huggingface")
    assert calls == [("acme/target", {"cache_dir": str(tmp_path), "revision": "v1"}),
                     ("acme/draft", {"cache_dir": str(tmp_path)})]
    resolve_model(core.model)  # the core's config resolves as it is
