"""Configuration of the HTTP front end (the engine's own settings live in ``bladellm.config``)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from bladellm.config import parse_size, parse_size_flag
from bladellm.entrypoints.openai.reasoning import REASONING_PARSERS
from bladellm.http.connections import ConnectionFlags, ConnectionLimits

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"--{name}: {msg}")


@dataclass
class ServerConfig(ConnectionFlags):  # + the connection flags (http/connections.py)
    host: str = field(
        default="0.0.0.0", metadata={"help": "Address to listen on (0.0.0.0: all interfaces)."})
    port: int = field(
        default=8081, metadata={"help": "TCP port to listen on; 0 picks a free port (the ready "
                                        "log line names it)."})
    api_key: str | None = field(
        default=None,
        metadata={"help": "If set, /v1/* requests must send 'Authorization: Bearer <key>'."})
    max_request_body_bytes: str = field(
        default="32MiB",
        metadata={"help": "Largest request body accepted (e.g. 32MiB, 1048576); larger ones "
                          "get HTTP 413."})
    max_prompts_per_request: int = field(
        default=1024,
        metadata={"help": "Most prompts one /v1/completions request may carry (a list of "
                          "texts or of token-id lists); more get HTTP 400 before the body is "
                          "parsed."})
    disable_docs: bool = field(
        default=False,
        metadata={"help": "Do not serve /docs, /redoc and /openapi.json (they stay open "
                          "without a key even under --api_key: they describe the API, not "
                          "the model)."})
    log_level: str = field(
        default="info", metadata={"help": f"Server log level: one of {', '.join(_LOG_LEVELS)}."})
    disable_access_log: bool = field(
        default=False, metadata={"help": "Do not log one line per HTTP request."})
    root_path: str = field(
        default="", metadata={"help": "ASGI root_path when served behind a path-prefixing proxy."})
    shutdown_timeout: float = field(
        default=10.0,
        metadata={"help": "On SIGINT/SIGTERM, new requests get 503 and in-flight ones get "
                          "this many seconds to finish; those still running then end with an "
                          "OpenAI error (503 body, or an SSE error event + [DONE])."})
    chat_template: str | None = field(
        default=None,
        metadata={"help": "Chat template for /v1/chat/completions instead of the tokenizer's: "
                          "a file path, or the Jinja template itself (vLLM's --chat-template)."})
    trust_request_chat_template: bool = field(
        default=False,
        metadata={"help": "Accept a Jinja chat template sent with a chat request "
                          "(chat_template / chat_template_kwargs.chat_template). Off: such "
                          "requests get 400, since the template runs in the API process."})
    keep_serving_on_engine_death: bool = field(
        default=False,
        metadata={"help": "When the engine core dies, keep the server up answering 503 "
                          "(the old behaviour). Off: in-flight requests get 503, then the "
                          "process exits with status 1 so an orchestrator restarts it."})
    metrics_names: str = field(
        default="both",
        metadata={"help": "Names of the /metrics series: vllm (vllm:* with a model_name "
                          "label, as vLLM publishes them), bladellm (bladellm_*), or both.",
                  "choices": ("both", "vllm", "bladellm")})
    reasoning_parser: str | None = field(
        default=None,
        metadata={"help": "Split a reasoning model's <think>...</think> thinking from its answer: "
                          "qwen3 (the model opens <think>; no tags, e.g. enable_thinking=false: "
                          "all answer) or deepseek_r1 (the template opens <think>: output before "
                          "</think> is thinking). Sent as reasoning_content / reasoning in chat, "
                          "reasoning items in Responses, thinking blocks in Messages; structured "
                          "output applies to the answer only.",
                  "choices": REASONING_PARSERS})
    retry_after: int = field(
        default=1,
        metadata={"help": "Retry-After seconds sent with HTTP 503 (overloaded or engine down)."})
    responses_store_max_entries: int = field(
        default=1024,
        metadata={"help": "Responses kept in memory for /v1/responses (store: true) for "
                          "previous_response_id and GET /v1/responses/{id}; the oldest goes "
                          "when full; 0 stores none."})
    responses_store_max_bytes: str = field(
        default="1GiB",
        metadata={"help": "Most bytes (as JSON) the /v1/responses store holds, e.g. 1GiB; the "
                          "oldest responses go when over; a response larger than this is not "
                          "kept."})
    responses_store_ttl: float = field(
        default=3600.0,
        metadata={"help": "Seconds a stored /v1/responses response stays retrievable."})

    def __post_init__(self) -> None:
        _check(bool(self.host), "host", "must not be empty")
        _check(0 <= self.port <= 65535, "port", f"must be in [0, 65535], got {self.port}")
        _check(self.api_key is None or self.api_key != "", "api_key", "must not be empty")
        parse_size_flag(self.max_request_body_bytes, "max_request_body_bytes")
        self.connection_limits  # noqa: B018 - validates the four connection flags
        _check(self.max_prompts_per_request >= 1, "max_prompts_per_request",
               f"must be >= 1, got {self.max_prompts_per_request}")
        self.log_level = self.log_level.lower()
        _check(self.log_level in _LOG_LEVELS, "log_level",
               f"must be one of {_LOG_LEVELS}, got {self.log_level!r}")
        _check(self.shutdown_timeout >= 0, "shutdown_timeout",
               f"must be >= 0, got {self.shutdown_timeout}")
        if self.chat_template is not None:
            _check(bool(self.chat_template.strip()), "chat_template", "must not be empty")
            looks_inline = any(c in self.chat_template for c in "{%\n")
            _check(looks_inline or os.path.isfile(self.chat_template), "chat_template",
                   f"no such file: {self.chat_template!r}")
        _check(self.metrics_names in ("both", "vllm", "bladellm"), "metrics_names",
               f"must be one of both, vllm, bladellm; got {self.metrics_names!r}")
        _check(self.reasoning_parser is None or self.reasoning_parser in REASONING_PARSERS,
               "reasoning_parser", f"must be one of {', '.join(REASONING_PARSERS)}; "
               f"got {self.reasoning_parser!r}")
        _check(self.retry_after >= 0, "retry_after", f"must be >= 0, got {self.retry_after}")
        _check(self.responses_store_max_entries >= 0, "responses_store_max_entries",
               f"must be >= 0, got {self.responses_store_max_entries}")
        parse_size_flag(self.responses_store_max_bytes, "responses_store_max_bytes")
        _check(self.responses_store_ttl > 0, "responses_store_ttl",
               f"must be > 0, got {self.responses_store_ttl}")

    def load_chat_template(self) -> str | None:
        """The template text: the file's content, or the flag's value when given inline."""
        if self.chat_template is None or not os.path.isfile(self.chat_template):
            return self.chat_template
        with open(self.chat_template, encoding="utf-8") as f:
            return f.read()

    @property
    def py_log_level(self) -> int:
        """``--log_level`` as a ``logging`` level (``trace`` is uvicorn's; DEBUG for us)."""
        return logging.DEBUG if self.log_level == "trace" else getattr(logging, self.log_level.upper())

    @property
    def connection_limits(self) -> ConnectionLimits:  # with --retry_after
        return ConnectionLimits(self.http_header_timeout, self.http_body_timeout,
                                self.http_keep_alive_timeout, self.max_connections,
                                self.retry_after)

    @property
    def max_body_bytes(self) -> int:
        return parse_size(self.max_request_body_bytes)

    @property
    def responses_store_bytes(self) -> int:
        return parse_size(self.responses_store_max_bytes)
