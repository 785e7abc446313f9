"""``--model org/name`` from a pre-populated hub cache, with no network: HF_HUB_OFFLINE,
--revision, --download_dir, the error when the model is not cached, ModelScope selection."""

import os
import shutil
import sys

import pytest

from bladellm.config import ModelConfig
from bladellm.engine.model_info import model_info_for
from bladellm.model.checkpoint import resolve_model
from bladellm.model.hub import is_model_id

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
