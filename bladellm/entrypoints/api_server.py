"""The FastAPI app (``build_app``) and the process around it (``run_server``).

``run_server`` starts the engine, then uvicorn on a socket it binds itself (so ``--port 0``
works and the ready line names the real port). SIGINT/SIGTERM refuse new requests, give
in-flight ones ``--shutdown_timeout`` seconds, finish the rest with an OpenAI error (see
``lifecycle.py``), then shut the engine down. A dead engine core makes the process exit with
status 1 after a short drain (unless ``--keep_serving_on_engine_death``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from bladellm.config import EngineConfig
from bladellm.entrypoints.anthropic.routes import add_anthropic_routes
from bladellm.entrypoints.openai.body_bounds import BodyBounds, parse_request
from bladellm.entrypoints.openai.config import ServerConfig
from bladellm.entrypoints.openai.lifecycle import Lifecycle, LifecycleMiddleware, watch_engine
from bladellm.entrypoints.openai.metrics import CONTENT_TYPE, PrometheusStatLogger
from bladellm.entrypoints.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, ModelCard, ModelList)
from bladellm.entrypoints.openai.serving_chat import create_chat_completion
from bladellm.entrypoints.openai.serving_common import ClientDisconnected, ServingContext
from bladellm.entrypoints.openai.serving_completion import create_completion
from bladellm.entrypoints.openai.protocol_responses import ResponsesRequest
from bladellm.entrypoints.openai.serving_responses import add_responses_routes
from bladellm.entrypoints.openai.openapi_bodies import declare_request_bodies
from bladellm.entrypoints.openai.serving_lora import (
    LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, adapter_cards, add_lora_routes)
from bladellm.entrypoints.openai.serving_embedding import (
    MAX_INPUTS, EmbeddingRequest, create_embedding)
from bladellm.entrypoints.openai.serving_tokenize import (
    DetokenizeRequest, TokenizeRequest, detokenize, tokenize)
from bladellm.errors import EngineDeadError
from bladellm.http.auth import api_key_check as _api_key_check
from bladellm.http.body_limit import BodyLimitMiddleware, RequestTooLarge, too_large
from bladellm.http.errors import APIError
from bladellm.http.handlers import from_exception, install_handlers
from bladellm.http.connections import (
    RateLimitedErrors, effective_max_connections, raise_open_file_limit, uvicorn_limits)
from bladellm.http.listen import bind_socket, open_listener_warning
from bladellm.platforms.heap import freeze_startup_heap
from bladellm.platforms.signals import caused_by_interrupt

logger = logging.getLogger("bladellm.server")


def server_version() -> str:
    import bladellm

    version = getattr(bladellm, "__version__", None)
    if version:
        return str(version)
    try:
        from importlib.metadata import version as dist_version

        return dist_version("bladellm")
    except Exception:  # noqa: BLE001 - not installed: running from a checkout
        return "0+unknown"


# ----------------------------------------------------------------------------------- routes


def build_app(engine: Any, server_config: ServerConfig,
              metrics: PrometheusStatLogger | None = None) -> FastAPI:
    """The HTTP app around a started engine (``AsyncLLM`` or a test double)."""
    docs = {} if not server_config.disable_docs else {
        "docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="BladeLLM", version=server_version(), root_path=server_config.root_path,
                  **docs)
    app.state.retry_after = server_config.retry_after
    app.state.engine = engine
    app.state.metrics = metrics = metrics or PrometheusStatLogger(
        model_name=engine.model_info.served_model_name, names=server_config.metrics_names)
    app.state.lifecycle = lifecycle = Lifecycle(server_config.retry_after)
    ctx = ServingContext.from_engine(engine, server_config)
    created = int(time.time())
    retry_after = server_config.retry_after
    install_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=server_config.max_body_bytes)
    app.add_middleware(LifecycleMiddleware, lifecycle=lifecycle)

    v1 = APIRouter(dependencies=[Depends(_api_key_check(server_config.api_key))])
    # Prompt fields bounded before a body is parsed (body_bounds.py).
    no_bounds = BodyBounds(ctx.max_model_len)
    body_bounds = {
        CompletionRequest: BodyBounds(ctx.max_model_len, {"prompt": (
            server_config.max_prompts_per_request, "--max_prompts_per_request")}),
        EmbeddingRequest: BodyBounds(ctx.max_model_len, {"input": (
            MAX_INPUTS, "OpenAI's limit")}, unbounded_by="truncate_prompt_tokens",
            generates=False)}

    async def serve(request: Request, model_cls: type, handler: Any) -> Response:
        # The request's LoRA adapter is held from its resolution until the handler is done;
        # by then a streamed response's engine streams have started and hold it themselves.
        request_ctx = ctx.for_request()
        try:
            if engine.is_dead:
                raise EngineDeadError(engine.dead_reason or "the engine died")
            req = await parse_request(model_cls, await request.body(),
                                      body_bounds.get(model_cls, no_bounds))
            return await handler(req, request, request_ctx)
        except ClientDisconnected:
            return Response(status_code=499)
        except ClientDisconnect:  # gone while uploading the body: nothing to answer, no error
            logger.info("client disconnected before sending the whole request body")
            return Response(status_code=499)
        except RequestTooLarge:
            return too_large(server_config.max_body_bytes).response()
        except Exception as exc:  # noqa: BLE001 - every error becomes an OpenAI error body
            return from_exception(exc, retry_after).response()
        finally:
            request_ctx.holds.release()

    @v1.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, CompletionRequest, create_completion)

    @v1.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, ChatCompletionRequest, create_chat_completion)

    @v1.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await serve(request, EmbeddingRequest, create_embedding)

    # vLLM's tokenizer endpoints (no /v1 prefix, as in vLLM; behind --api_key like /v1/*).
    @v1.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await serve(request, TokenizeRequest, tokenize)

    @v1.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await serve(request, DetokenizeRequest, detokenize)

    def model_card() -> ModelCard:
        return ModelCard(id=ctx.model_name, created=created, max_model_len=ctx.max_model_len)

    def all_cards() -> list[ModelCard]:
        return [model_card(), *adapter_cards(engine, ctx.model_name, created, ctx.max_model_len)]

    @v1.get("/v1/models")
    async def list_models() -> Response:
        return Response(ModelList(data=all_cards()).model_dump_json(),
                        media_type="application/json")

    @v1.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        card = next((c for c in all_cards() if c.id == model_id), None)
        if card is None:
            raise APIError(404, f"The model `{model_id}` does not exist.",
                           "invalid_request_error", param="model", code="model_not_found")
        return Response(card.model_dump_json(), media_type="application/json")

    add_responses_routes(v1, ctx, server_config, serve)  # /v1/responses (serving_responses)
    add_lora_routes(v1, engine)
    add_anthropic_routes(app, v1, serve)  # Anthropic's /v1/messages (entrypoints/anthropic)

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        try:
            if engine.is_dead:
                raise EngineDeadError(engine.dead_reason or "the engine died")
            await engine.check_health()
        except EngineDeadError as exc:
            return from_exception(exc, retry_after).response()
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": server_version()})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        if engine.is_dead:
            metrics.zero_engine_gauges()  # a dead core runs nothing and holds no KV blocks
        else:
            stats = engine.get_scheduler_stats()
            if stats is not None:
                metrics.update_gauges(stats)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    declare_request_bodies(app, {
        "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
        "/v1/embeddings": EmbeddingRequest, "/tokenize": TokenizeRequest,
        "/detokenize": DetokenizeRequest, "/v1/responses": ResponsesRequest,
        "/v1/load_lora_adapter": LoadLoRAAdapterRequest,
        "/v1/unload_lora_adapter": UnloadLoRAAdapterRequest})
    return app


# ------------------------------------------------------------------------------- the process


class _Server(uvicorn.Server):
    """uvicorn, with SIGINT/SIGTERM starting ``Lifecycle.drain`` instead of an immediate exit
    (a second signal forces it) and an exit status."""

    def __init__(self, config: uvicorn.Config, model_name: str, engine: Any,
                 lifecycle: Lifecycle, grace: float) -> None:
        super().__init__(config)
        self.model_name = model_name
        self.engine = engine
        self.lifecycle = lifecycle
        self.grace = grace
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._captured_signals.append(sig)  # re-raised after serve(): KeyboardInterrupt
        if self.lifecycle.draining or self._loop is None or not self.started:
            self.should_exit = self.force_exit = True  # second signal, or not serving yet
            return
        self.lifecycle.draining = True
        self._loop.call_soon_threadsafe(self._spawn, self._drain_then_exit())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain_then_exit(self) -> None:
        await self.lifecycle.drain(self.engine, self.grace)
        self.should_exit = True

    def exit_now(self, code: int) -> None:
        self.exit_code = code
        self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.set_exception_handler(RateLimitedErrors())  # e.g. accept() out of files
        await super().startup(sockets)
        if self.started:
            freeze_startup_heap()  # GC passes here stall the event loop every stream waits on
        if self.started and sockets:
            host, port = sockets[0].getsockname()[:2]
            host = f"[{host}]" if ":" in host else host
            logger.info("BladeLLM server ready at http://%s:%d (model '%s')", host, port,
                        self.model_name)


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _configure_logging(server_config: ServerConfig) -> None:
    py_level = server_config.py_log_level
    logging.basicConfig(level=py_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("bladellm").setLevel(py_level)


def _metrics_for(engine_config: EngineConfig, server_config: ServerConfig) -> PrometheusStatLogger:
    """The model_name label is the served name, named here as the engine will name it (from
    the --model text alone: no hub access, no file read)."""
    from bladellm.checkpoint.locate import default_served_name
    from bladellm.checkpoint.demo import resolve_model_path

    name = engine_config.model.served_model_name
    if name is None:
        name = default_served_name(engine_config.model.model,
                                   resolve_model_path(engine_config.model.model))
    check_lora_module_names(engine_config, name)
    return PrometheusStatLogger(model_name=name, names=server_config.metrics_names)


def check_lora_module_names(engine_config: EngineConfig, served_name: str) -> None:
    """Before the engine starts: a ``--lora_modules`` name equal to the base model's served name
    could never be selected (``model`` = that name is the base model)."""
    path = engine_config.lora.named_modules.get(served_name)
    if path is not None:
        raise ValueError(f"--lora_modules {served_name}={path}: '{served_name}' is the base "
                         "model's served name; an adapter under it could never be selected")


async def _serve(engine_config: EngineConfig, server_config: ServerConfig,
                 client: Any = None) -> int:
    from bladellm.engine.async_llm import AsyncLLM

    metrics = _metrics_for(engine_config, server_config)
    logger.info("starting the engine for model %s", engine_config.model.model)
    engine = AsyncLLM.from_engine_config(engine_config, stat_loggers=[metrics], client=client)
    sock = None
    try:
        sock = bind_socket(server_config.host, server_config.port)
        warning = open_listener_warning(server_config.host, server_config.api_key)
        if warning:
            logger.warning(warning)
        app = build_app(engine, server_config, metrics=metrics)
        # Our own drain has finished every request before uvicorn's shutdown starts; its
        # timeout only bounds connections that still will not close (e.g. a stalled reader).
        limits = effective_max_connections(server_config.connection_limits,
                                           raise_open_file_limit())
        config = uvicorn.Config(
            app, log_level=server_config.log_level, access_log=not server_config.disable_access_log,
            root_path=server_config.root_path, timeout_graceful_shutdown=1,
            **uvicorn_limits(limits))
        server = _Server(config, engine.model_info.served_model_name, engine,
                         app.state.lifecycle, server_config.shutdown_timeout)
        watcher = None
        if not server_config.keep_serving_on_engine_death:
            watcher = asyncio.ensure_future(watch_engine(
                engine, app.state.lifecycle, server_config.shutdown_timeout,
                lambda: server.exit_now(1)))
        try:
            await server.serve(sockets=[sock])
        finally:
            if watcher is not None:
                watcher.cancel()
        return server.exit_code
    finally:
        logger.info("shutting down the engine")
        engine.shutdown()
        if sock is not None:
            sock.close()


def run_server(engine_config: EngineConfig, server_config: ServerConfig,
               client: Any = None) -> int:
    """Run until SIGINT/SIGTERM; returns the process exit status. ``client``: an engine core
    started early for ``engine_config`` (``AsyncMPClient(..., wait=False)``); closed on failure."""
    _configure_logging(server_config)
    # Fail fast, before loading a model, if the port is taken. The real socket is bound after
    # the engine process has started so that it never inherits the listening socket.
    if server_config.port:
        try:
            bind_socket(server_config.host, server_config.port).close()
        except OSError as exc:
            logger.error("cannot listen on %s:%d: %s", server_config.host, server_config.port,
                         exc)
            if client is not None:
                client.close()
            return 1
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        code = asyncio.run(_serve(engine_config, server_config, client))
    except KeyboardInterrupt:
        pass
    except (ValueError, RuntimeError, OSError) as exc:  # bad model dir, engine start-up failure
        if caused_by_interrupt(exc):  # a signal during an import, wrapped by it
            return 0
        logger.debug("start-up failed", exc_info=exc)
        logger.error("cannot start the server: %s", exc)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code:
        logger.error("server stopped: the engine core died (exit status %d)", code)
        return code
    logger.info("server stopped")
    return 0
