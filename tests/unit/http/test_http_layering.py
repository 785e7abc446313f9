"""The HTTP plumbing sits below the servers: the router and the Ray Serve ingress use
``bladellm.http`` and ``bladellm.errors``, never the OpenAI server package (which would put the
router above the CLI that starts it), and ``bladellm.http`` itself imports no server or engine."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

_LOADED = ("import sys\n"
           "for name in {modules!r}:\n"
           "    __import__(name)\n"
           "print('\\n'.join(sorted(m for m in sys.modules if m == 'torch'\n"
           "                        or m.startswith({forbidden!r}))))\n")


def _loaded(modules: list[str], forbidden: tuple[str, ...]) -> list[str]:
    """The ``forbidden`` modules loaded by importing ``modules`` in a fresh interpreter."""
    code = _LOADED.format(modules=modules, forbidden=forbidden)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    return out.stdout.split()


def test_router_imports_nothing_from_the_server_package():
    modules = ["bladellm.router", "bladellm.router.config", "bladellm.router.metrics",
               "bladellm.router.policy", "bladellm.router.pool", "bladellm.router.prompt",
               "bladellm.router.proxy"]
    assert _loaded(modules, ("bladellm.entrypoints",)) == []


def test_ray_serve_package_and_cli_import_nothing_from_the_server_package():
    modules = ["bladellm.serve", "bladellm.serve.__main__"]  # Ray loads inside main() only
    assert _loaded(modules, ("bladellm.entrypoints",)) == []


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs the ray extra")
def test_ray_serve_deployments_import_nothing_from_the_server_package():
    modules = ["bladellm.serve.ray_router", "bladellm.serve.app"]
    assert _loaded(modules, ("bladellm.entrypoints",)) == []


def test_http_and_errors_are_below_the_servers_and_the_engine():
    modules = ["bladellm.errors", "bladellm.http", "bladellm.http.auth",
               "bladellm.http.body_limit", "bladellm.http.disconnect", "bladellm.http.errors",
               "bladellm.http.handlers", "bladellm.http.listen"]
    assert _loaded(modules, ("bladellm.entrypoints", "bladellm.engine", "bladellm.router",
                             "bladellm.serve")) == []
