"""BladeLLM on Ray Serve with a local Ray cluster bound to 127.0.0.1: two replicas of the tiny
model's server behind ``PrefixAffinityRequestRouter``. Needs the ``ray`` extra; slow (Ray and
two servers start on two CPUs)."""

from __future__ import annotations

import os
import socket

import httpx
import pytest

# Before Ray is imported (it reads them at import): no usage stats, and a node address of
# 127.0.0.1 kept as it is (by default Ray swaps a loopback node address for the machine's
# external one, and its gRPC servers then listen on every interface).
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from test_router import shared_prefix_workload  # noqa: E402 - tests/e2e is on sys.path

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_app(tiny_model_factory, tmp_path_factory):
    from bladellm.serve.app import build_app

    model = tiny_model_factory("llama")
    temp = tmp_path_factory.mktemp("ray")
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=4,
             _temp_dir=str(temp), configure_logging=False)
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(["--model", model, "--served_model_name", "tiny", "--dtype", "float32",
                         "--max_model_len", "512", "--num_kv_blocks", "512", "--num_threads",
                         "1", "--disable_access_log"], num_replicas=2),
              name="bladellm", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def test_shared_prefixes_stick_to_one_replica_and_sse_streams(ray_app):
    placed: dict[str, set[str]] = {}
    with httpx.Client(timeout=120) as c:
        for p in shared_prefix_workload(seed=11):
            r = c.post(ray_app + "/v1/completions",
                       json={"model": "tiny", "prompt": p, "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            placed.setdefault(p[:40], set()).add(r.headers["x-bladellm-instance"])
        stream = c.post(ray_app + "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 8, "ignore_eos": True, "stream": True})
        models = c.get(ray_app + "/v1/models").json()
    assert all(len(v) == 1 for v in placed.values()), placed
    assert len(set().union(*placed.values())) == 2  # the documents spread over both replicas
    assert stream.headers["content-type"].startswith("text/event-stream")
    assert stream.content.endswith(b"data: [DONE]\n\n")
    assert models["data"][0]["id"] == "tiny"
