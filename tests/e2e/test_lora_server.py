"""LoRA through the real server: adapters picked by ``model`` (name, path under --lora_root),
path-traversal and symlink attempts refused, vLLM's load/unload endpoints through the official
``openai`` client and raw HTTP, ``/v1/models`` listing adapters with ``parent``."""

from __future__ import annotations

import os
import signal
import subprocess

import httpx
import openai
import pytest

from e2e.test_server import ServerProcess
from tiny_lora import make_adapter

API_KEY = "lora-key"


@pytest.fixture(scope="module")
def dirs(tiny_llama, tmp_path_factory):
    base = tmp_path_factory.mktemp("lora-e2e")
    root, outside = base / "root", base / "outside"
    root.mkdir()
    outside.mkdir()
    make_adapter(tiny_llama, root / "a1", r=4, targets=["q_proj", "v_proj"], seed=1)
    make_adapter(tiny_llama, root / "a2", r=8, targets=["o_proj", "down_proj"], seed=2)
    make_adapter(tiny_llama, root / "big", r=32, targets=["q_proj"], seed=3)
    make_adapter(tiny_llama, outside / "secret", r=4, targets=["q_proj"], seed=4)
    (root / "empty").mkdir()
    os.symlink(outside / "secret", root / "link")
    return {"root": str(root), "outside": str(outside)}


@pytest.fixture(scope="module")
def server(tiny_llama, dirs):
    srv = ServerProcess([
        "--model", tiny_llama, "--served_model_name", "tiny", "--host", "127.0.0.1",
        "--port", "0", "--dtype", "float32", "--max_model_len", "128", "--num_kv_blocks", "256",
        "--api_key", API_KEY, "--disable_access_log", "--num_threads", "1",
        "--enable_lora", "--max_loras", "1", "--max_cpu_loras", "2",
        "--lora_modules", f"named={dirs['root']}/a1", "--lora_root", dirs["root"]])
    srv.wait_ready(timeout=240)
    yield srv
    srv.proc.send_signal(signal.SIGTERM)
    try:
        srv.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        srv.proc.kill()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=60)


def _complete(client: openai.OpenAI, model: str) -> str:
    resp = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=8,
                                     temperature=0.0)
    assert resp.model == model
    return resp.choices[0].text


def test_models_list_adapters(client):
    cards = {m.id: m for m in client.models.list().data}
    assert cards["tiny"].model_extra.get("parent") is None
    assert cards["named"].model_extra["parent"] == "tiny"


def test_adapter_by_name_and_by_path(client, dirs):
    base = _complete(client, "tiny")
    by_name = _complete(client, "named")
    assert by_name != base
    assert _complete(client, f"{dirs['root']}/a1") == by_name  # absolute path under the root
    assert _complete(client, "a1") == by_name  # relative to the root
    assert _complete(client, "a2") not in (base, by_name)
    assert _complete(client, "tiny") == base
    chat = client.chat.completions.create(model="named", max_tokens=4, temperature=0.0,
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.model == "named" and chat.choices[0].message.content


@pytest.mark.parametrize("model", [
    "{outside}/secret", "{root}/../outside/secret", "../outside/secret", "link",
    "{root}/link", "{root}/empty", "{root}/missing", "/etc", "..", "a1/../../outside/secret"])
def test_paths_outside_root_refused(client, dirs, model):
    with pytest.raises(openai.NotFoundError) as exc:
        _complete(client, model.format(**dirs))
    assert exc.value.body["code"] == "model_not_found"


def test_unservable_adapter_is_400(client):
    with pytest.raises(openai.BadRequestError, match="max_lora_rank"):
        _complete(client, "big")


def test_load_unload_raw_http(server, dirs):
    url, auth = server.url, {"Authorization": f"Bearer {API_KEY}"}
    body = {"lora_name": "dyn", "lora_path": f"{dirs['root']}/a2"}
    with httpx.Client(timeout=60) as http:
        assert http.post(url + "/v1/load_lora_adapter", json=body).status_code == 401
        r = http.post(url + "/v1/load_lora_adapter", json=body, headers=auth)
        assert r.status_code == 200 and "added successfully" in r.text
        assert http.post(url + "/v1/load_lora_adapter", json=body,
                         headers=auth).status_code == 400  # already loaded
        r = http.post(url + "/v1/load_lora_adapter", headers=auth,
                      json={"lora_name": "x", "lora_path": f"{dirs['root']}/../outside/secret"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = http.post(url + "/v1/load_lora_adapter", headers=auth,
                      json={"lora_name": "y", "lora_path": f"{dirs['root']}/big"})
        assert r.status_code == 400 and "max_lora_rank" in r.json()["error"]["message"]
        ids = [m["id"] for m in http.get(url + "/v1/models", headers=auth).json()["data"]]
        assert "dyn" in ids and "x" not in ids and "y" not in ids
        r = http.post(url + "/v1/completions", headers=auth,
                      json={"model": "dyn", "prompt": "hello", "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert http.post(url + "/v1/unload_lora_adapter", json={"lora_name": "dyn"}
                         ).status_code == 401
        r = http.post(url + "/v1/unload_lora_adapter", json={"lora_name": "dyn"}, headers=auth)
        assert r.status_code == 200 and "removed successfully" in r.text
        r = http.post(url + "/v1/unload_lora_adapter", json={"lora_name": "dyn"}, headers=auth)
        assert r.status_code == 404
        r = http.post(url + "/v1/completions", headers=auth,
                      json={"model": "dyn", "prompt": "hello", "max_tokens": 4})
        assert r.status_code == 404


def test_load_unload_openai_client(client, dirs):
    reply = client.post("/load_lora_adapter", cast_to=str,
                        body={"lora_name": "via-client", "lora_path": f"{dirs['root']}/a1"})
    assert "added successfully" in reply
    assert _complete(client, "via-client") == _complete(client, "named")
    assert "via-client" in [m.id for m in client.models.list().data]
    reply = client.post("/unload_lora_adapter", cast_to=str, body={"lora_name": "via-client"})
    assert "removed successfully" in reply
    with pytest.raises(openai.NotFoundError):
        _complete(client, "via-client")
    with pytest.raises(openai.NotFoundError):
        client.post("/unload_lora_adapter", cast_to=str, body={"lora_name": "via-client"})
