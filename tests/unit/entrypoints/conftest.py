import os
import sys

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from fake_engine import FakeAsyncLLM  # noqa: E402

from bladellm.entrypoints.openai.config import ServerConfig  # noqa: E402
from bladellm.entrypoints.api_server import build_app  # noqa: E402


@pytest.fixture
def engine() -> FakeAsyncLLM:
    return FakeAsyncLLM()


@pytest.fixture
def make_client():
    """make_client(engine, **server_config) -> httpx.AsyncClient bound to the ASGI app."""

    def make(engine, **server_kw) -> httpx.AsyncClient:
        app = build_app(engine, ServerConfig(**server_kw))
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://testserver")

    return make


@pytest.fixture
async def client(engine, make_client):
    async with make_client(engine) as c:
        yield c
