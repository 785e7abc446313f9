"""A bounded adapter registry (issue 37 items 5 and 7): one adapter per resolved directory
whatever the spelling, at most --max_lora_entries dynamic entries (LRU eviction of unused ones),
a name length limit, /v1/models without server paths, a 404 that names --lora_root, a start-up
warning when no adapter can be reached, and ``~`` resolved under the root rules."""

from __future__ import annotations

import logging
import os
import sys
from types import SimpleNamespace

import httpx
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "entrypoints"))
sys.path.insert(0, os.path.dirname(__file__))

from fake_engine import FakeAsyncLLM  # noqa: E402
from test_lora_adapter import write  # noqa: E402

from bladellm.config import LoRAConfig  # noqa: E402
from bladellm.entrypoints.openai.config import ServerConfig  # noqa: E402
from bladellm.entrypoints.api_server import build_app  # noqa: E402
from bladellm.lora.adapter import LoRAError  # noqa: E402
from bladellm.lora.registry import (  # noqa: E402
    LoRANotFoundError, LoRARegistry, LoRARegistryFullError)

HF = SimpleNamespace(hidden_size=8, intermediate_size=16, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=4, num_hidden_layers=2)


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "root"
    for n in ("a1", "a2", "a3", "a4", "a5"):
        write(r / n, {})
    return r


def registry(root, **kw) -> LoRARegistry:
    return LoRARegistry(LoRAConfig(enable_lora=True, lora_root=[str(root)], **kw), HF)


def test_every_spelling_of_a_path_is_one_adapter(root, monkeypatch):
    reg = registry(root)
    monkeypatch.chdir(root.parent)
    spellings = ["a1", "./a1", "././a1", "a1/.", "a1/", f"{root}/a1", f"{root}/../root/a1",
                 "a2/../a1"]
    ids = {reg.resolve(s).lora_int_id for _ in range(100) for s in spellings}
    assert len(ids) == 1
    assert [a.lora_name for a in reg.adapters()] == ["a1"]


def test_dynamic_entries_are_capped_with_lru_eviction_of_unused_ones(root):
    reg = registry(root, max_lora_entries=3)
    a1, a2, a3 = (reg.resolve(n) for n in ("a1", "a2", "a3"))
    reg.resolve("a1")  # a1 used again: a2 is now the least recently used
    reg.acquire(a2)  # ... but running
    a4 = reg.resolve("a4")  # evicts a3 (a2 is in use)
    assert {a.lora_name for a in reg.adapters()} == {"a1", "a2", "a4"}
    assert reg.num_dynamic == 3
    reg.acquire(a1)
    reg.acquire(a4)
    with pytest.raises(LoRARegistryFullError, match="--max_lora_entries 3"):
        reg.resolve("a5")
    reg.release(a4)
    a5 = reg.resolve("a5")  # a4 is free again
    assert {a.lora_name for a in reg.adapters()} == {"a1", "a2", "a5"}
    # Forgotten ones come back under a new id (their KV blocks are not shared by mistake).
    reg.release(a1)
    reg.release(a2)
    again = reg.resolve("a3")
    assert again.lora_int_id not in {a1.lora_int_id, a2.lora_int_id, a3.lora_int_id,
                                     a4.lora_int_id, a5.lora_int_id}


def test_a_thousand_requests_keep_the_registry_bounded(root):
    reg = registry(root, max_lora_entries=2)
    for i in range(1000):
        reg.resolve(["a1", "./a2", "a3/.", "a4", "a5"][i % 5])
    assert len(reg.adapters()) == 2 and len(reg._by_id) == 2


def test_operator_adapters_are_never_evicted_nor_counted(root):
    reg = registry(root, max_lora_entries=1, lora_modules=[f"named={root}/a1"])
    reg.resolve("a2")
    reg.resolve("a3")
    assert {a.lora_name for a in reg.adapters()} == {"named", "a3"}


def test_names_and_paths_have_a_length_limit(root):
    reg = registry(root)
    with pytest.raises(LoRAError, match="at most 128 characters"):
        reg.add("n" * 129, f"{root}/a1", named=True)
    with pytest.raises(LoRANotFoundError, match="longer than"):
        reg.resolve("./" * 600 + "a1")


def test_tilde_is_resolved_under_the_root_rules(root, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    reg = registry(root)
    assert reg.resolve("~/root/a1").lora_name == "a1"
    write(tmp_path / "outside", {})
    with pytest.raises(LoRANotFoundError):
        reg.resolve("~/outside")


def test_warning_when_no_adapter_can_be_reached(caplog):
    with caplog.at_level(logging.WARNING):
        LoRARegistry(LoRAConfig(enable_lora=True), HF)
    assert "--lora_root" in caplog.text and "no adapter can be used" in caplog.text


def _client(reg) -> httpx.AsyncClient:
    engine = FakeAsyncLLM()
    engine.lora_registry = reg
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, ServerConfig())),
                             base_url="http://t")


async def test_models_list_names_not_server_paths(root):
    reg = registry(root)
    reg.resolve(f"{root}/a1")
    async with _client(reg) as c:
        cards = (await c.get("/v1/models")).json()["data"]
    assert [(m["id"], m["root"]) for m in cards[1:]] == [("a1", "a1")]
    assert str(root) not in str(cards)


async def test_404_names_lora_root(root, tmp_path):
    reg = LoRARegistry(LoRAConfig(enable_lora=True), HF)
    async with _client(reg) as c:
        r = await c.post("/v1/completions", json={"model": f"{root}/a1", "prompt": "x"})
    assert r.status_code == 404, r.text
    assert "--lora_root" in r.json()["error"]["message"]


def test_max_lora_entries_is_validated():
    with pytest.raises(ValueError, match="--max_lora_entries"):
        LoRAConfig(enable_lora=True, max_lora_entries=0)
    with pytest.raises(ValueError, match="--max_lora_entries"):
        LoRAConfig(max_lora_entries=5)  # only with --enable_lora
