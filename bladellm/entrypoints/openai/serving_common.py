"""What /v1/completions and /v1/chat/completions share: request checks, sampling parameters,
merging the per-prompt engine streams, client-disconnect handling, usage and logprobs."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, TypeVar

import msgspec
from fastapi import Request

from bladellm.engine.cpu_offload import CpuOffload
from bladellm.errors import ContextLengthError, RequestFailedError, request_error
from bladellm.engine.input_processor import context_length_message
from bladellm.engine.prompt_limits import prompt_char_limit
from bladellm.http.disconnect import until_disconnect as _until_disconnect
from bladellm.http.errors import APIError, bad_request, unsupported
from bladellm.entrypoints.openai.reasoning import ReasoningParser, get_reasoning_parser
from bladellm.entrypoints.openai.structured_output import guided_decoding_from_request
from bladellm.entrypoints.openai.protocol import (
    ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, PromptTokensDetails, SamplingRequest,
    TopLogprob, UsageInfo)
from bladellm.outputs import RequestOutput, TokenLogprob
from bladellm.sampling_params import SamplingParams

T = TypeVar("T")

MAX_N = 128  # choices per request; more is almost surely a mistake and would flood the queue
_DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_FALLBACKS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
              "repetition_penalty": 1.0}
_MIN_LOGPROB = -9999.0  # JSON has no -inf


class ClientDisconnected(Exception):
    """The client went away before the response was ready; the request was aborted."""


@dataclass
class AdapterHolds:
    """The LoRA adapters one HTTP request holds (not evictable from the registry), from the
    moment ``check_model`` resolves them until ``release``: through the prompt work, until the
    engine streams hold their own (``_holding_adapter``)."""

    _held: list[tuple[Any, Any]] = field(default_factory=list)  # (registry, LoRARequest)

    def add(self, registry: Any, lora: Any) -> None:
        self._held.append((registry, lora))

    def release(self) -> None:
        """Each hold released once, however often this is called."""
        while self._held:
            registry, lora = self._held.pop()
            registry.release(lora)


@dataclass
class ServingContext:
    """What a handler needs from the engine and the server config."""

    engine: Any  # AsyncLLM or a test double with the same interface
    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Any
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # Tokenization / templating / large decodes run here, off the event loop (shared with the
    # engine's own tokenization when it has one: one thread touches the tokenizer).
    offload: CpuOffload = field(default_factory=CpuOffload)
    max_prompt_chars: int | None = None  # cheap pre-tokenization bound (prompt_limits.py)
    trust_request_chat_template: bool = False
    default_chat_template: str | None = None  # --chat_template: replaces the tokenizer's
    reasoning_parser: ReasoningParser | None = None  # --reasoning_parser
    max_prompts_per_request: int = 1024  # --max_prompts_per_request
    # This request's adapter holds (``for_request``); None: adapters are resolved unheld.
    holds: AdapterHolds | None = None

    @classmethod
    def from_engine(cls, engine: Any, server_config: Any = None) -> "ServingContext":
        info = engine.model_info
        offload = getattr(engine, "cpu_offload", None) or CpuOffload()
        return cls(engine=engine, model_name=info.served_model_name,
                   max_model_len=info.max_model_len, vocab_size=info.vocab_size,
                   tokenizer=info.tokenizer, sampling_defaults=dict(info.sampling_defaults),
                   offload=offload,
                   max_prompt_chars=prompt_char_limit(info.tokenizer, info.max_model_len),
                   trust_request_chat_template=bool(getattr(
                       server_config, "trust_request_chat_template", False)),
                   default_chat_template=server_config.load_chat_template()
                   if server_config is not None else None,
                   reasoning_parser=get_reasoning_parser(
                       getattr(server_config, "reasoning_parser", None)),
                   max_prompts_per_request=getattr(server_config, "max_prompts_per_request",
                                                   1024))

    def for_request(self) -> "ServingContext":
        """This context for one HTTP request, with its own adapter holds: the caller releases
        them (``holds.release()``) once the handler has returned or raised."""
        return dataclasses.replace(self, holds=AdapterHolds())

    async def check_model(self, name: str | None) -> Any:
        """None for the base model, the ``LoRARequest`` an adapter name or path resolves to
        (``--enable_lora``); 404 for anything else, 400 for an adapter that cannot be served.
        The adapter is resolved in a worker thread (its directory is read) and, with ``holds``,
        held from then on."""
        if name is None or name == self.model_name:
            return None
        if not name:
            raise APIError(400, "model: must not be empty", "invalid_request_error",
                           param="model")
        registry = getattr(self.engine, "lora_registry", None)
        why = ""
        if registry is not None:
            from bladellm.lora.registry import LoRANotFoundError, LoRARegistryFullError

            try:
                lora = await self._resolve(registry, name)
            except LoRANotFoundError as exc:
                why = (f" It is not a LoRA adapter either: {exc} (adapters are named by "
                       f"--lora_modules or /v1/load_lora_adapter, or by a path under a "
                       f"--lora_root).")
            except LoRARegistryFullError as exc:
                raise APIError(503, str(exc), "server_error", param="model",
                               code="lora_registry_full", headers={"Retry-After": "1"}) from None
            else:
                # The engine knows an adapter by id and path; the response names it as sent.
                return lora if lora.lora_name == name else msgspec.structs.replace(
                    lora, lora_name=name)
        raise APIError(404, f"The model `{name}` does not exist.{why}", "invalid_request_error",
                       param="model", code="model_not_found")

    async def _resolve(self, registry: Any, name: str) -> Any:
        holds = self.holds
        if holds is None or not hasattr(registry, "acquire"):
            return await self.offload.run(registry.resolve, name)
        # Resolved and held in one step in the thread. Shielded: a client gone meanwhile does
        # not stop the thread, so its hold is then released when it is done, not left behind.
        work = asyncio.ensure_future(self.offload.run(registry.resolve, name, hold=True))
        try:
            lora = await asyncio.shield(work)
        except asyncio.CancelledError:
            work.add_done_callback(lambda done: done.cancelled() or done.exception() is not None
                                   or registry.release(done.result()))
            raise
        holds.add(registry, lora)
        return lora

    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                 lora: Any = None, priority: int = 0, images: list | None = None) -> Any:
        """The engine's stream for one prompt, with the request's LoRA adapter and scheduling
        priority if any (the engine refuses a priority other than 0 under fcfs: a 400); an
        adapter is marked in use (not evictable from the registry) while its stream lives."""
        kwargs: dict[str, Any] = {}
        if lora is not None:
            kwargs["lora_request"] = lora
        if priority != 0:
            kwargs["priority"] = priority
        if images:  # PIL images of the chat's image_url parts, in order
            kwargs["images"] = images
        stream = self.engine.generate(prompt, params, request_id, **kwargs)
        registry = getattr(self.engine, "lora_registry", None)
        if lora is None or registry is None or not hasattr(registry, "acquire"):
            return stream
        return _holding_adapter(stream, registry, lora)


async def _holding_adapter(stream: AsyncIterator[T], registry: Any, lora: Any) -> AsyncIterator[T]:
    """``stream``, with its adapter marked in use (not evicted from the registry) meanwhile."""
    registry.acquire(lora)
    try:
        async for item in stream:
            yield item
    finally:
        registry.release(lora)
        await _aclose(stream)


# ------------------------------------------------------------------------- request checking


def reject_unsupported(req: SamplingRequest) -> None:
    """400 for every field this server declares but cannot honour."""
    if req.best_of is not None:
        if req.best_of < req.n:
            raise bad_request(f"best_of ({req.best_of}) must be >= n ({req.n})", "best_of")
        if req.best_of > req.n:
            raise unsupported("best_of", "best_of > n")
    if req.use_beam_search:
        raise unsupported("use_beam_search", "beam search")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true",
                          "stream_options")
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"n: must be in [1, {MAX_N}], got {req.n}", "n")


def build_sampling_params(req: SamplingRequest, ctx: ServingContext, *, max_tokens: int | None,
                          logprobs: int | None,
                          forced_constraint: tuple[str, dict[str, Any]] | None = None,
                          max_tokens_param: str = "max_tokens") -> SamplingParams:
    """SamplingParams from a request; unset fields take the model's generation_config values.
    ``forced_constraint``: (field, constraint) the server adds (a forced tool call).
    ``max_tokens_param``: the request field ``max_tokens`` came from, for error messages."""
    values: dict[str, Any] = {}
    values["guided_decoding"] = guided_decoding_from_request(req, forced_constraint)
    for name in _DEFAULTABLE:
        value = getattr(req, name)
        if value is None:
            value = ctx.sampling_defaults.get(name, _FALLBACKS[name])
        values[name] = value
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{max_tokens_param}: must be >= 1, got {max_tokens}",
                          max_tokens_param)
    if max_tokens is not None and max_tokens > ctx.max_model_len:
        raise bad_request(f"{max_tokens_param}: {max_tokens} exceeds the model's context length "
                          f"({ctx.max_model_len} tokens)", max_tokens_param)
    if req.min_tokens > ctx.max_model_len:
        raise bad_request(f"min_tokens: {req.min_tokens} exceeds the model's context length "
                          f"({ctx.max_model_len} tokens)", "min_tokens")
    logit_bias = None
    if req.logit_bias:
        try:
            logit_bias = {int(tok): float(bias) for tok, bias in req.logit_bias.items()}
        except ValueError:
            raise bad_request("logit_bias: keys must be token ids (integers as strings)",
                              "logit_bias") from None
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    return SamplingParams(
        n=req.n, max_tokens=max_tokens, stop=stop or None, seed=req.seed,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0, logit_bias=logit_bias,
        ignore_eos=req.ignore_eos, stop_token_ids=req.stop_token_ids or None,
        min_tokens=req.min_tokens, skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output, logprobs=logprobs, **values)


# --------------------------------------------------------------------- streams and disconnects


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Yield ``(stream index, item)`` from several async iterators as items arrive.

    An exception from any stream is re-raised here; closing this generator (or an error)
    cancels and closes every stream, which aborts their requests in the engine.

    Each stream is consumed in its own task, even when there is only one: Starlette cancels a
    streaming response through an anyio cancel scope, which re-cancels every ``await`` of the
    cancelled task, so an engine generator's cleanup (the abort) must not run in that task.
    """
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, None, exc))
        finally:
            queue.put_nowait((i, done, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is done:
                remaining -= 1
                continue
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        # Not gather(): if this wait is itself cancelled, gather would cancel the tasks again,
        # possibly in the middle of their streams' cleanup.
        await asyncio.wait(tasks)
        for stream in streams:
            await _aclose(stream)


async def _aclose(stream: Any) -> None:
    close = getattr(stream, "aclose", None)
    if close is not None:
        try:
            await close()
        except RuntimeError:
            pass  # still running in a task being cancelled; that task closes it


async def until_disconnect(awaitable: Awaitable[T], request: Request) -> T:
    """Await ``awaitable`` unless the client disconnects first; then cancel it (aborting its
    engine requests) and raise ``ClientDisconnected``."""
    return await _until_disconnect(awaitable, request, ClientDisconnected)


def context_length_error(exc: ContextLengthError, prompt_param: str,
                         max_tokens_param: str = "max_tokens") -> APIError:
    """The engine's "does not fit in the context" as a 400 naming the request's own fields:
    ``param`` is the prompt's field when the prompt alone leaves no room for output, else the
    max-tokens field that made it overflow; ``code`` is OpenAI's ``context_length_exceeded``."""
    message = context_length_message(exc.num_prompt_tokens, exc.max_tokens, exc.max_model_len,
                                     prompt_param, max_tokens_param)
    culprit = prompt_param if exc.max_tokens is None or exc.prompt_overflows \
        else max_tokens_param
    return bad_request(message, culprit, code="context_length_exceeded")


async def naming_context_errors(awaitable: Awaitable[T], prompt_param: str,
                                max_tokens_param: str = "max_tokens") -> T:
    """Await ``awaitable``; a ``ContextLengthError`` from the engine becomes
    ``context_length_error``'s 400."""
    try:
        return await awaitable
    except ContextLengthError as exc:
        raise context_length_error(exc, prompt_param, max_tokens_param) from None


def check_output(out: RequestOutput) -> None:
    """Raise for a request the engine failed: a 400 naming the field when the client's
    constraint failed (llguidance could not follow it further), else a 500."""
    if out.error is not None:
        raise request_error(out.error_kind, out.error)
    for comp in out.outputs:
        if comp.finish_reason == "error":
            raise RequestFailedError(f"choice {comp.index} failed in the engine")


# -------------------------------------------------------------------------- usage, logprobs


@dataclass
class UsageCounter:
    """Prompt tokens counted once per prompt, completion tokens per generated token."""

    prompt_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)
    completion_tokens: int = 0

    def add(self, stream: int, out: RequestOutput) -> None:
        self.prompt_tokens[stream] = len(out.prompt_token_ids)
        self.cached_tokens[stream] = max(out.num_cached_tokens,
                                         self.cached_tokens.get(stream, 0))
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)

    def usage(self) -> UsageInfo:
        prompt = sum(self.prompt_tokens.values())
        return UsageInfo(prompt_tokens=prompt, completion_tokens=self.completion_tokens,
                         total_tokens=prompt + self.completion_tokens,
                         prompt_tokens_details=PromptTokensDetails(
                             cached_tokens=sum(self.cached_tokens.values())))


def json_logprob(value: float) -> float:
    """A logprob JSON can carry (no -inf, no NaN)."""
    return max(value, _MIN_LOGPROB) if not math.isnan(value) else _MIN_LOGPROB


def legacy_top_logprobs(token: TokenLogprob, top: list[TokenLogprob]) -> dict[str, float]:
    """A legacy-completions ``top_logprobs`` entry: the ``top`` alternatives plus the chosen
    ``token`` itself when it is not among them (so up to ``logprobs + 1`` entries, and
    ``{token: logprob}`` for ``logprobs: 0``), as OpenAI and vLLM do."""
    result = {t.decoded: json_logprob(t.logprob) for t in top}
    if token.decoded not in result:
        result[token.decoded] = json_logprob(token.logprob)
    return result


def completion_logprobs(entries: list[list[TokenLogprob]], text_offset: int,
                        into: CompletionLogprobs | None = None) -> CompletionLogprobs:
    """OpenAI legacy-completions logprobs; ``text_offset`` is where the first token starts."""
    into = into or CompletionLogprobs()
    offset = text_offset
    for token in entries:
        sampled, top = token[0], token[1:]
        into.tokens.append(sampled.decoded)
        into.token_logprobs.append(json_logprob(sampled.logprob))
        into.top_logprobs.append(legacy_top_logprobs(sampled, top))
        into.text_offset.append(offset)
        offset += len(sampled.decoded)
    return into


def _top(t: TokenLogprob) -> TopLogprob:
    # ``bytes``: the token's raw bytes (a piece of a multi-byte character for a token whose
    # ``token`` string is U+FFFD), so consecutive tokens' bytes concatenate to the text's UTF-8.
    raw = t.token_bytes if t.token_bytes is not None else t.decoded.encode("utf-8")
    return TopLogprob(token=t.decoded, logprob=json_logprob(t.logprob), bytes=list(raw))


def chat_logprobs(entries: list[list[TokenLogprob]]) -> ChatLogprobs:
    content = []
    for token in entries:
        sampled = _top(token[0])
        content.append(ChatTokenLogprob(token=sampled.token, logprob=sampled.logprob,
                                        bytes=sampled.bytes,
                                        top_logprobs=[_top(t) for t in token[1:]]))
    return ChatLogprobs(content=content)


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def stream_usage_flags(options) -> tuple[bool, bool, set[str] | None]:
    """From ``stream_options``: (usage chunk at the end, usage in every chunk, fields to exclude
    from each chunk's JSON)."""
    include_usage = bool(options and options.include_usage)
    continuous = bool(include_usage and options.continuous_usage_stats)
    return include_usage, continuous, None if include_usage else {"usage"}
