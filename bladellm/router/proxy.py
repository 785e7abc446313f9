"""The router's HTTP app: forwards OpenAI and Anthropic requests to the instance a policy picks.

A request is committed to an instance only once something can be sent to the client: a whole
non-streamed response, or the first bytes of a stream. Until then a failure (connection refused
or dropped, or a 502/503 from the instance) sends it to another healthy instance, at most
``--max_retries`` times. ``--request_timeout`` running out once connected is no instance
failure: a 504 (or an in-band error in a started stream), never re-sent, as the request may be
running there. A client leaving before any byte came back closes the upstream request too.
After that, a broken stream ends with an in-band error event in the protocol of its path
(chat and completions: ``data: {"error": ...}``, then ``data: [DONE]``, as the server itself does;
Responses: an ``error`` event; Messages: Anthropic's ``error`` event). Streamed bytes pass
through exactly as they arrive, chunk by chunk, never buffered.

Stored responses (``/v1/responses/{id}`` and ``previous_response_id``) live in the store of the
instance that created them: the router finds that instance by asking every instance
(``_locate``), so the lookup needs no router state and survives a router restart. When an
instance that may hold it is down, the answer is a 503 saying so, never a 404 that is wrong.
The router's own errors on the Messages paths are in Anthropic's shape (``AnthropicErrors``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import quote

import aiohttp
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect

from bladellm.http.anthropic_errors import PATHS as ANTHROPIC_PATHS
from bladellm.http.anthropic_errors import AnthropicErrors, anthropic_error
from bladellm.http.auth import api_key_check
from bladellm.http.body_limit import BodyLimitMiddleware, RequestTooLarge, too_large
from bladellm.http.disconnect import until_disconnect
from bladellm.http.errors import APIError
from bladellm.http.handlers import install_handlers
from bladellm.router.config import RouterConfig
from bladellm.router.metrics import render_instance_metrics
from bladellm.router.policy import PrefixAffinity, make_policy
from bladellm.router.pool import Instance, InstancePool, Ticket
from bladellm.router.prompt import request_info

logger = logging.getLogger("bladellm.router")

INSTANCE_HEADER = "X-BladeLLM-Instance"
# x-api-key and anthropic-*: Anthropic's clients authenticate and version with these.
_PASS_REQUEST_HEADERS = ("authorization", "content-type", "accept", "x-request-id",
                         "x-api-key", "anthropic-version", "anthropic-beta")
_PASS_RESPONSE_HEADERS = ("content-type", "cache-control", "x-accel-buffering", "retry-after",
                          "www-authenticate", "x-request-id")
_RETRY_STATUSES = (502, 503)  # the instance is down or overloaded: another may serve it
_CONNECTION_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


def _is_request_timeout(exc: BaseException) -> bool:
    """A timeout after the request may have reached the instance (``--request_timeout`` ran
    out): the instance is not known to be broken, and the request may be running there, so it
    is neither taken out nor the request re-sent. A connect timeout (the instance could not be
    reached at all) is a connection failure like a refused connection."""
    return (isinstance(exc, asyncio.TimeoutError)
            and not isinstance(exc, aiohttp.ConnectionTimeoutError))


class _ClientGone(Exception):
    """The client disconnected before anything was sent back to it."""


async def _close_if_relay(result: Any) -> None:
    if isinstance(result, _RelayResponse):  # ready just as the client left: never sent
        await result.close_upstream()


async def _until_disconnect(awaitable: Any, request: Request) -> Any:
    """Await ``awaitable`` unless the client disconnects first; then cancel it (which closes the
    upstream connection, so the instance aborts the request) and raise ``_ClientGone``."""
    return await until_disconnect(awaitable, request, _ClientGone, discard=_close_if_relay)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("bladellm_router_requests", "Requests answered, by instance "
                                "and outcome (ok, error_status, broken_stream, timeout, "
                                "client_gone).",
                                ["instance", "outcome"], registry=r)
        self.retries = Counter("bladellm_router_retries", "Requests sent to another instance "
                               "after one failed before anything reached the client.",
                               ["instance"], registry=r)
        self.no_instance = Counter("bladellm_router_no_instance", "Requests answered 503 "
                                   "because no healthy instance was left.", registry=r)
        self.up = Gauge("bladellm_router_instance_up", "1 while an instance takes requests.",
                        ["instance"], registry=r)
        self.in_flight = Gauge("bladellm_router_in_flight", "Requests in flight, by instance.",
                               ["instance"], registry=r)
        self.outstanding = Gauge("bladellm_router_outstanding_tokens", "Estimated tokens left "
                                 "to process for the requests in flight.", ["instance"],
                                 registry=r)

    def snapshot(self, instances: list[Instance]) -> None:
        for i in instances:
            self.up.labels(instance=i.url).set(1 if i.healthy else 0)
            self.in_flight.labels(instance=i.url).set(i.in_flight)
            self.outstanding.labels(instance=i.url).set(i.outstanding_tokens)


def _response_headers(resp: aiohttp.ClientResponse, instance: Instance) -> dict[str, str]:
    headers = {k: v for k, v in resp.headers.items() if k.lower() in _PASS_RESPONSE_HEADERS}
    headers[INSTANCE_HEADER] = instance.url
    return headers


RESPONSES = "/v1/responses"


def _sse_error(path: str, message: str, type_: str = "server_error",
               code: str = "upstream_error", status: int = 502) -> bytes:
    """The in-band error that ends a broken stream, in the protocol of ``path``."""
    if path in ANTHROPIC_PATHS:
        _, body = anthropic_error(status, message, code)
        return f"event: error\ndata: {json.dumps(body)}\n\n".encode()
    if path == RESPONSES:  # the Responses stream's error event (no [DONE] in that protocol)
        event = {"type": "error", "code": code, "message": message, "param": None}
        return f"event: error\ndata: {json.dumps(event)}\n\n".encode()
    body = APIError(status, message, type_, code=code).body()
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


class _RelayResponse(StreamingResponse):
    """A stream whose upstream side is cleaned up however the response ends: Starlette never
    starts the body iterator when the client is gone before the first chunk."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Any, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def close_upstream(self) -> None:
        await self._on_close()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


class Router:
    """State shared by the routes: config, pool, policy, metrics and the HTTP session."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.policy = make_policy(config.policy, config.overload_margin,
                                  config.affinity_cache_blocks,
                                  config.affinity_balance_factor or None)
        on_back = self.policy.forget if isinstance(self.policy, PrefixAffinity) else None
        self.pool = InstancePool(config.instances, config.health_check_failures, on_back)
        self.metrics = RouterMetrics()
        self.session: aiohttp.ClientSession | None = None
        self.timeout = aiohttp.ClientTimeout(total=config.request_timeout,
                                             sock_connect=config.connect_timeout)

    async def start(self) -> asyncio.Task:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             auto_decompress=False)
        return asyncio.create_task(self.pool.run_health_checks(
            self.session, self.config.health_check_interval, self.config.health_check_timeout))

    async def stop(self) -> None:
        if self.session is not None:
            await self.session.close()

    # ---- forwarding ---------------------------------------------------------------------

    async def _body(self, request: Request) -> bytes | Response:
        """The request body, or the answer when there is none to forward: a 413 for a chunked
        upload over --max_request_body_bytes (BodyLimitMiddleware counts it as it arrives), a
        499 for a client gone while uploading."""
        try:
            return await request.body()
        except RequestTooLarge:
            return too_large(self.config.max_body_bytes).response()
        except ClientDisconnect:
            return Response(status_code=499)

    @staticmethod
    def _headers(request: Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() in _PASS_REQUEST_HEADERS}

    async def forward(self, request: Request, path: str, use_policy: bool = True,
                      pinned: Instance | None = None) -> Response:
        """Send the request to an instance (by the policy, or with ``use_policy=False`` the least
        busy one, or ``pinned``: that one only), retrying elsewhere while nothing has reached
        the client. A Responses request that continues a stored one (``previous_response_id``)
        goes to the instance that stores it."""
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        try:
            parsed: Any = json.loads(body) if body else None
        except ValueError:
            parsed = None  # the instance answers it with the proper 400
        headers = self._headers(request)
        previous = parsed.get("previous_response_id") if isinstance(parsed, dict) else None
        if path == RESPONSES and isinstance(previous, str) and pinned is None:
            located = await self._locate(previous, headers, request)
            if isinstance(located, Response):
                return located
            pinned = located  # None: no instance stores it; any one answers the 404
        info = request_info(parsed, self.config.affinity_block_chars,
                            self.config.affinity_max_blocks)
        tried: set[str] = set()
        last: Response | None = None
        failed: Instance | None = None  # the instance the previous attempt failed on
        for _ in range(self.config.max_retries + 1):
            candidates = [i for i in self.pool.healthy(tried) if pinned is None or i is pinned]
            if not candidates:
                break
            if failed is not None:  # counted only when another attempt really follows
                self.metrics.retries.labels(instance=failed.url).inc()
            if use_policy:
                instance = self.policy.choose(info, candidates)
            else:  # no prompt cache involved: the least busy, the first listed on ties
                instance = min(candidates, key=lambda i: i.load_requests)
            tried.add(instance.url)
            ticket = self.pool.admit(instance, info)
            try:
                result = await _until_disconnect(
                    self._try(instance, request.method, path, body, headers, ticket), request)
            except _ClientGone:
                ticket.release()
                self.metrics.requests.labels(instance=instance.url, outcome="client_gone").inc()
                logger.info("client left before %s answered; upstream request closed",
                            instance.url)
                return Response(status_code=499)
            if isinstance(result, Response) and not (
                    result.status_code in _RETRY_STATUSES and pinned is None
                    and self.pool.healthy(tried)):
                return result
            last = result if isinstance(result, Response) else last
            failed = instance
        if last is not None:
            return last
        self.metrics.no_instance.inc()
        if pinned is not None:
            return APIError(503, f"The instance that stores the response this request refers "
                                 f"to ({pinned.url}) is not available; retry later.",
                            "server_error", code="no_healthy_instance",
                            headers={"Retry-After": "1"}).response()
        return APIError(503, "No healthy instance is available to serve the request.",
                        "server_error", code="no_healthy_instance",
                        headers={"Retry-After": "1"}).response()

    async def _locate(self, response_id: str, headers: dict[str, str],
                      request: Request) -> Instance | Response | None:
        """The instance whose store holds response ``response_id``: every healthy instance is
        asked (``GET /v1/responses/{id}``), the one answering 200 holds it. None when every
        instance answered 404: nobody has it. A ``Response`` when that cannot be told: an
        instance down or unreachable may hold it (503, naming it), or an instance refused the
        lookup itself (its answer, e.g. a 401)."""
        assert self.session is not None
        path = f"{RESPONSES}/{quote(response_id, safe='')}"
        timeout = aiohttp.ClientTimeout(total=self.config.health_check_timeout)

        async def probe(instance: Instance) -> tuple[Instance, int, bytes, dict[str, str]]:
            try:
                async with self.session.get(instance.url + path, headers=headers,
                                            timeout=timeout) as resp:
                    return (instance, resp.status, await resp.read(),
                            _response_headers(resp, instance))
            except _CONNECTION_ERRORS:
                return instance, 0, b"", {}

        healthy = self.pool.healthy()
        try:
            results = await _until_disconnect(
                asyncio.gather(*(probe(i) for i in healthy)), request)
        except _ClientGone:
            return Response(status_code=499)
        for instance, status, _, _ in results:
            if status == 200:
                return instance
        for _, status, content, resp_headers in results:
            if status not in (0, 404):  # e.g. 401: the lookup itself was refused
                return Response(content, status, resp_headers)
        unknown = [i.url for i in self.pool.instances if i not in healthy]
        unknown += [r[0].url for r in results if r[1] == 0]
        if unknown:
            return APIError(503, f"Response '{response_id}' is not on the reachable "
                                 f"instances; {', '.join(unknown)} may store it but cannot be "
                                 f"reached now (a stored response lives on the instance that "
                                 f"created it); retry later.", "server_error",
                            code="instance_unavailable", headers={"Retry-After": "1"}).response()
        return None

    async def forward_stored(self, request: Request, response_id: str, suffix: str) -> Response:
        """``/v1/responses/{id}[suffix]`` (retrieve, delete, cancel, input items): sent to the
        instance that stores the response; a 404 only when no instance has it."""
        path = f"{RESPONSES}/{quote(response_id, safe='')}{suffix}"
        if request.url.query:
            path += f"?{request.url.query}"
        # Read (and cached on the request) before the lookup watches the connection for a
        # disconnect, which consumes what the client sends.
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        located = await self._locate(response_id, self._headers(request), request)
        if isinstance(located, Response):
            return located
        if located is None:  # every instance said 404: any one's answer is the right one
            return await self.forward(request, path, use_policy=False)
        return await self.forward(request, path, pinned=located)

    def _timeout_error(self) -> APIError:
        return APIError(504, f"The instance did not answer within --request_timeout "
                             f"({self.config.request_timeout:g} s). The request was not sent "
                             f"to another instance, as it may have run on this one.",
                        "timeout", code="upstream_timeout")

    async def _try(self, instance: Instance, method: str, path: str, body: bytes,
                   headers: dict[str, str], ticket: Ticket) -> Response | None:
        """Send to one instance; None when it failed before anything could reach the client.
        Cancelled (the client left), it closes the upstream connection and re-raises."""
        assert self.session is not None
        resp = None
        try:
            resp = await self.session.request(method, instance.url + path, data=body or None,
                                              headers=headers, timeout=self.timeout)
            if resp.content_type != "text/event-stream" or resp.status != 200:
                content = await resp.read()
                ticket.release()
                outcome = "ok" if resp.status < 400 else "error_status"
                self.metrics.requests.labels(instance=instance.url, outcome=outcome).inc()
                return Response(content, resp.status, _response_headers(resp, instance))
            first = await resp.content.readany()
            if not first:
                raise aiohttp.ServerDisconnectedError("the stream ended before its first byte")
        except _CONNECTION_ERRORS as exc:
            ticket.release()
            if resp is not None:
                resp.close()
            if _is_request_timeout(exc):  # the instance is slow, not gone: no failover
                self.metrics.requests.labels(instance=instance.url, outcome="timeout").inc()
                logger.info("request to %s timed out (--request_timeout %g s); answered 504",
                            instance.url, self.config.request_timeout)
                return self._timeout_error().response()
            self.pool.mark_down(instance, f"{type(exc).__name__}: {exc}")
            logger.info("request to %s failed before anything was sent back (%s); retrying "
                        "elsewhere", instance.url, type(exc).__name__)
            return None
        except BaseException:
            ticket.release()
            if resp is not None:
                resp.close()
            raise
        stream = self._relay(instance, resp, first, ticket, path)

        async def on_close() -> None:  # also when the client left before the stream started
            await stream.aclose()
            ticket.release()
            resp.close()

        return _RelayResponse(stream, on_close, status_code=resp.status,
                              headers=_response_headers(resp, instance))

    async def _relay(self, instance: Instance, resp: aiohttp.ClientResponse, first: bytes,
                     ticket: Ticket, path: str) -> AsyncGenerator[bytes, None]:
        """Yield the instance's bytes as they arrive; end a broken stream with an error event.
        Closing this generator (the client went away) closes the upstream connection, which
        aborts the request on the instance."""
        completed = False
        try:
            chunk = first
            while chunk:
                ticket.generated(chunk.count(b"data:"))
                yield chunk
                chunk = await resp.content.readany()
            completed = True
            self.metrics.requests.labels(instance=instance.url, outcome="ok").inc()
        except _CONNECTION_ERRORS as exc:
            if _is_request_timeout(exc):  # slow, not broken: the instance stays in service
                self.metrics.requests.labels(instance=instance.url, outcome="timeout").inc()
                err = self._timeout_error()
                yield _sse_error(path, err.message, err.type, err.code or "upstream_timeout",
                                 err.status)
                return
            self.pool.mark_down(instance, f"stream broken: {type(exc).__name__}")
            self.metrics.requests.labels(instance=instance.url, outcome="broken_stream").inc()
            yield _sse_error(path, f"The instance serving this request failed mid-stream "
                                   f"({type(exc).__name__}); the partial answer cannot be "
                                   f"resumed.")
        finally:
            ticket.release()
            if completed:
                resp.release()
            else:
                resp.close()

    async def broadcast(self, request: Request, path: str) -> Response:
        """Send the request to every instance (LoRA adapters must be loaded on all of them).
        All succeed: the first instance's answer. All fail alike with a client error (e.g.
        adapter not found): that answer, as one server would give it. Otherwise a 502 naming
        each instance's result, so the client can repair the ones that failed."""
        assert self.session is not None
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        headers = self._headers(request)

        async def one(instance: Instance) -> tuple[Instance, int, bytes, dict[str, str]]:
            try:
                async with self.session.request(request.method, instance.url + path,
                                                data=body or None, headers=headers,
                                                timeout=self.timeout) as resp:
                    return (instance, resp.status, await resp.read(),
                            _response_headers(resp, instance))
            except _CONNECTION_ERRORS as exc:
                return instance, 0, f"{type(exc).__name__}: {exc}".encode(), {}

        try:
            results = await _until_disconnect(
                asyncio.gather(*(one(i) for i in self.pool.instances)), request)
        except _ClientGone:
            return Response(status_code=499)
        ok = [r for r in results if 200 <= r[1] < 300]
        if len(ok) == len(results):
            _, status, content, resp_headers = ok[0]
            resp_headers[INSTANCE_HEADER] = ",".join(r[0].url for r in results)
            return Response(content, status, resp_headers)
        statuses = {r[1] for r in results}
        if not ok and len(statuses) == 1 and 400 <= results[0][1] < 500:
            _, status, content, resp_headers = results[0]
            resp_headers[INSTANCE_HEADER] = ",".join(r[0].url for r in results)
            return Response(content, status, resp_headers)

        def detail(content: bytes) -> str:
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                return str(json.loads(content)["error"]["message"])
            return content.decode("utf-8", "replace")[:500]

        failed = [r for r in results if not 200 <= r[1] < 300]
        message = (f"{path} failed on {len(failed)} of {len(results)} instances: "
                   + "; ".join(f"{r[0].url}: {r[1] or 'unreachable'} {detail(r[2])}"
                               for r in failed)
                   + (f" (succeeded on {', '.join(r[0].url for r in ok)})" if ok else ""))
        err = APIError(502, message, "server_error", code="instance_failures")
        per_instance = [{"url": r[0].url, "status": r[1] or None, "ok": 200 <= r[1] < 300,
                         "detail": detail(r[2])} for r in results]
        return JSONResponse({**err.body(), "instances": per_instance}, status_code=502)

    # ---- aggregated endpoints -----------------------------------------------------------

    def health(self) -> Response:
        instances = [{"url": i.url, "healthy": i.healthy, "in_flight": i.in_flight}
                     for i in self.pool.instances]
        if any(i.healthy for i in self.pool.instances):
            return JSONResponse({"status": "ok", "instances": instances})
        err = APIError(503, "No healthy instance.", "server_error", code="no_healthy_instance",
                       headers={"Retry-After": "1"})
        return JSONResponse({**err.body(), "instances": instances}, status_code=503,
                            headers=err.headers)

    async def metrics_text(self) -> bytes:
        assert self.session is not None
        self.metrics.snapshot(self.pool.instances)
        timeout = aiohttp.ClientTimeout(total=self.config.health_check_timeout)

        async def scrape(instance: Instance) -> tuple[str, str]:
            with contextlib.suppress(*_CONNECTION_ERRORS):
                async with self.session.get(instance.url + "/metrics", timeout=timeout) as r:
                    if r.status == 200:
                        return instance.url, await r.text()
            return instance.url, ""

        texts = await asyncio.gather(*(scrape(i) for i in self.pool.healthy()))
        return generate_latest(self.metrics.registry) + render_instance_metrics(dict(texts))


def build_router_app(config: RouterConfig) -> FastAPI:
    router = Router(config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = await router.start()
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await router.stop()

    app = FastAPI(title="BladeLLM router", lifespan=lifespan)
    app.state.router = router
    install_handlers(app)
    # Bodies are read whole before forwarding (a request goes to another instance when one
    # fails): without a limit one huge upload would take the router's memory.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    # Outermost: the router's own errors on the Messages paths (401, 413, 503, 504) in
    # Anthropic's shape, as the server answers them.
    app.add_middleware(AnthropicErrors)
    v1 = APIRouter(dependencies=[Depends(api_key_check(config.api_key))])

    def forwarding(path: str, use_policy: bool) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            return await router.forward(request, path, use_policy=use_policy)
        return endpoint

    def broadcasting(path: str) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            return await router.broadcast(request, path)
        return endpoint

    # Generation goes where the policy says (load, prompt-cache affinity); a Responses request
    # with previous_response_id goes where that response is stored.
    for path in ("/v1/completions", "/v1/chat/completions", RESPONSES, "/v1/messages"):
        v1.add_api_route(path, forwarding(path, True), methods=["POST"])
    v1.add_api_route("/v1/models", forwarding("/v1/models", True), methods=["GET"])

    @v1.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        return await router.forward(request, f"/v1/models/{model_id}")

    # Stored responses live on the instance that created them.
    @v1.get(RESPONSES + "/{response_id}")
    async def retrieve_response(request: Request, response_id: str) -> Response:
        return await router.forward_stored(request, response_id, "")

    @v1.delete(RESPONSES + "/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        return await router.forward_stored(request, response_id, "")

    @v1.get(RESPONSES + "/{response_id}/input_items")
    async def response_input_items(request: Request, response_id: str) -> Response:
        return await router.forward_stored(request, response_id, "/input_items")

    @v1.post(RESPONSES + "/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str) -> Response:
        return await router.forward_stored(request, response_id, "/cancel")

    # Served by any one instance (no prompt cache to aim at): the least busy.
    for path in ("/v1/embeddings", "/tokenize", "/detokenize", "/v1/messages/count_tokens"):
        v1.add_api_route(path, forwarding(path, False), methods=["POST"])
    # Adapters must be on every instance: sent to all of them.
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        v1.add_api_route(path, broadcasting(path), methods=["POST"])

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        return router.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await router.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    return app
