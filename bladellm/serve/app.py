"""Ray Serve deployments: each replica runs one ``blade_llm_server`` process (any of its flags)
and relays its answers; an OpenAI ingress sends every request through a deployment handle,
where ``PrefixAffinityRequestRouter`` picks the replica.

The first item a replica yields is ``{"status", "content_type", "instance"}``; the rest are the
server's bytes as they arrive, so SSE streams through Ray unchanged.
"""


import re
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig

from bladellm.http.errors import APIError
from bladellm.router.proxy import INSTANCE_HEADER
from bladellm.serve.ray_router import PrefixAffinityRequestRouter

_READY = re.compile(r"ready at (http://[\d.]+:\d+)")


@serve.deployment
class BladeLLMReplica:
    def __init__(self, server_args: list[str], start_timeout: float = 600.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bladellm.entrypoints.cli.server", *server_args, "--host",
             "127.0.0.1", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True)
        self.url = self._wait_ready(start_timeout)
        self.session: aiohttp.ClientSession | None = None

    def _wait_ready(self, timeout: float) -> str:
        import threading

        found: list[str] = []
        done = threading.Event()

        def drain() -> None:  # keeps reading so the server never blocks on a full pipe
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                m = _READY.search(line)
                if m and not found:
                    found.append(m.group(1))
                    done.set()
            done.set()

        threading.Thread(target=drain, daemon=True).start()
        if not done.wait(timeout) or not found:
            self.proc.kill()
            raise RuntimeError("blade_llm_server did not start in this replica")
        return found[0]

    async def check_health(self) -> None:  # Ray Serve restarts a replica whose server died
        if self.proc.poll() is not None:
            raise RuntimeError(f"blade_llm_server exited with {self.proc.returncode}")

    async def __call__(self, path: str, body: dict[str, Any] | None
                       ) -> AsyncIterator[dict[str, Any] | bytes]:
        if self.session is None:
            self.session = aiohttp.ClientSession(auto_decompress=False)
        method = "GET" if body is None else "POST"
        async with self.session.request(method, self.url + path, json=body) as resp:
            yield {"status": resp.status, "content_type": resp.headers.get("content-type", ""),
                   "instance": self.url}
            while chunk := await resp.content.readany():
                yield chunk

    def __del__(self) -> None:
        if getattr(self, "proc", None) is not None and self.proc.poll() is None:
            self.proc.terminate()


ingress_app = FastAPI(title="BladeLLM on Ray Serve")


@serve.deployment
@serve.ingress(ingress_app)
class OpenAIIngress:
    def __init__(self, replicas: Any) -> None:
        self.replicas = replicas.options(stream=True)

    async def _forward(self, path: str, body: dict[str, Any] | None) -> Response:
        stream = self.replicas.remote(path, body)
        try:
            meta = await stream.__anext__()
        except Exception as exc:  # noqa: BLE001 - the replica is gone: a clean 503
            return APIError(503, f"No replica could serve the request: {type(exc).__name__}",
                            "server_error", code="no_healthy_instance").response()
        headers = {INSTANCE_HEADER: meta["instance"]}
        return StreamingResponse(stream, status_code=meta["status"],
                                 media_type=meta["content_type"] or None, headers=headers)

    @ingress_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._forward("/v1/completions", await request.json())

    @ingress_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._forward("/v1/chat/completions", await request.json())

    @ingress_app.get("/v1/models")
    async def models(self) -> Response:
        return await self._forward("/v1/models", None)


def build_app(server_args: list[str], num_replicas: int, overload_margin: int = 4,
              affinity_block_chars: int = 128, affinity_balance_factor: float = 0.0) -> Any:
    """The Ray Serve application: ``num_replicas`` servers behind the affinity router."""
    router = RequestRouterConfig(
        request_router_class=PrefixAffinityRequestRouter,
        request_router_kwargs={"overload_margin": overload_margin,
                               "affinity_block_chars": affinity_block_chars,
                               "affinity_balance_factor": affinity_balance_factor})
    replica = BladeLLMReplica.options(num_replicas=num_replicas,
                                      request_router_config=router).bind(server_args)
    return OpenAIIngress.bind(replica)
