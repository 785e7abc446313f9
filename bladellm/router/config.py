"""Configuration of ``blade_llm_router`` (one validated dataclass; the CLI is generated from it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlparse

from bladellm.config import parse_size, parse_size_flag
from bladellm.http.connections import ConnectionFlags

POLICIES = ("round_robin", "least_tokens", "prefix_affinity")
# The knobs of the prefix_affinity policy only.
_AFFINITY_FIELDS = ("affinity_block_chars", "affinity_max_blocks", "affinity_cache_blocks",
                    "overload_margin", "affinity_balance_factor")


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"--{name}: {msg}")


@dataclass
class RouterConfig(ConnectionFlags):  # + the connection flags (http/connections.py)
    instances: list[str] = field(
        default_factory=list,
        metadata={"help": "Base URLs of the OpenAI-compatible instances, e.g. "
                          "http://10.0.0.1:8081 http://10.0.0.2:8081."})
    policy: str = field(
        default="prefix_affinity",
        metadata={"help": "Routing policy: round_robin, least_tokens (least outstanding "
                          "tokens) or prefix_affinity (prompt-cache affinity, falling back to "
                          "the least loaded instance when the preferred one is overloaded).",
                  "choices": POLICIES})
    host: str = field(default="0.0.0.0", metadata={"help": "Address to listen on."})
    port: int = field(default=8080, metadata={"help": "TCP port; 0 picks a free port."})
    api_key: str | None = field(
        default=None,
        metadata={"help": "If set, /v1/* requests must send 'Authorization: Bearer <key>' (as "
                          "blade_llm_server). The header is passed on to the instances."})
    affinity_block_chars: int = field(
        default=128,
        metadata={"help": "prefix_affinity: characters per prompt block that is hashed "
                          "(~32 tokens of English text)."})
    affinity_max_blocks: int = field(
        default=256, metadata={"help": "prefix_affinity: leading blocks of a prompt hashed."})
    affinity_cache_blocks: int = field(
        default=65536,
        metadata={"help": "prefix_affinity: block hashes remembered per instance (LRU), an "
                          "approximation of what its prompt cache holds."})
    overload_margin: int = field(
        default=4,
        metadata={"help": "prefix_affinity: the preferred instance is skipped when it has more "
                          "than this many requests in flight beyond the least busy instance."})
    affinity_balance_factor: float = field(
        default=0.0,
        metadata={"help": "prefix_affinity: bounded loads. An instance takes a request only "
                          "while it then has at most ceil(c * (m + 1) / n) requests in flight "
                          "(m in flight on all n instances); a prefix whose instance is full "
                          "goes to the one with the next-longest match that has room. 0 (default) "
                          "turns the bound off (only --overload_margin applies); c = 1.25 "
                          "lowered the hit rate on the RAG benchmark (docs/benchmarks.md)."})
    health_check_interval: float = field(
        default=2.0, metadata={"help": "Seconds between /health and /metrics polls."})
    health_check_timeout: float = field(
        default=5.0, metadata={"help": "Seconds a /health poll may take."})
    health_check_failures: int = field(
        default=2,
        metadata={"help": "Consecutive failed polls that take an instance out (a refused "
                          "connection while proxying takes it out at once); one good poll puts "
                          "it back."})
    connect_timeout: float = field(
        default=5.0, metadata={"help": "Seconds to open a connection to an instance."})
    request_timeout: float = field(
        default=3600.0, metadata={"help": "Seconds a proxied request may take in all."})
    max_retries: int = field(
        default=2,
        metadata={"help": "Other instances tried when one fails before anything was sent to "
                          "the client."})
    max_request_body_bytes: str = field(
        default="32MiB",
        metadata={"help": "Largest request body the router accepts (e.g. 32MiB, 1048576), as "
                          "the server's flag of that name; larger ones get HTTP 413 before "
                          "the router buffers them."})
    log_level: str = field(default="info", metadata={"help": "Log level."})

    def __post_init__(self) -> None:
        _check(len(self.instances) >= 1, "instances", "give at least one instance URL")
        cleaned = []
        for url in self.instances:
            parsed = urlparse(url)
            _check(parsed.scheme in ("http", "https") and bool(parsed.netloc), "instances",
                   f"{url!r} is not an http(s)://host:port URL")
            cleaned.append(url.rstrip("/"))
        _check(len(set(cleaned)) == len(cleaned), "instances", "an instance is listed twice")
        self.instances = cleaned
        _check(self.policy in POLICIES, "policy", f"must be one of {POLICIES}")
        _check(0 <= self.port <= 65535, "port", f"must be in [0, 65535], got {self.port}")
        _check(self.api_key is None or self.api_key != "", "api_key", "must not be empty")
        for name in ("affinity_block_chars", "affinity_max_blocks", "affinity_cache_blocks",
                     "health_check_failures"):
            _check(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        _check(self.overload_margin >= 0, "overload_margin", "must be >= 0")
        _check(self.affinity_balance_factor == 0 or self.affinity_balance_factor >= 1,
               "affinity_balance_factor",
               f"must be 0 (off) or >= 1, got {self.affinity_balance_factor}")
        _check(self.max_retries >= 0, "max_retries", "must be >= 0")
        parse_size_flag(self.max_request_body_bytes, "max_request_body_bytes")
        if self.policy != "prefix_affinity":
            # Read only by the prefix_affinity policy (router/policy.py, the prompt's block
            # hashes in router/prompt.py): with another policy they would be ignored.
            for name in _AFFINITY_FIELDS:
                default = RouterConfig.__dataclass_fields__[name].default
                _check(getattr(self, name) == default, name,
                       f"only used with --policy prefix_affinity (got --policy {self.policy})")
        for name in ("health_check_interval", "health_check_timeout", "connect_timeout",
                     "request_timeout"):
            _check(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        self.connection_limits  # noqa: B018 - validates the four flags (ValueError naming one)
        self.log_level = self.log_level.lower()
        _check(self.log_level in ("critical", "error", "warning", "info", "debug"), "log_level",
               f"unknown level {self.log_level!r}")

    @property
    def max_body_bytes(self) -> int:
        return parse_size(self.max_request_body_bytes)

