"""What the router reads from a request body: the prompt's leading block hashes and a cost.

The router never tokenizes: prefix affinity works on the prompt *text*, cut into blocks of
``block_chars`` characters, each hash chaining its parent's (as the engine's prompt cache chains
token blocks), so two prompts share hash ``i`` exactly when their first ``(i + 1) * block_chars``
characters are equal. Chat messages are flattened into one text in order (role, then content),
which a chat template turns into the same leading tokens. Token counts are estimated as UTF-8
bytes / 4 (docs/router.md says why that is enough for balancing).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

BYTES_PER_TOKEN = 4
_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat gets the same guess


@dataclass(frozen=True)
class RequestInfo:
    block_hashes: tuple[bytes, ...]  # chained hashes of the prompt's leading full blocks
    prompt_tokens: int  # estimate
    max_tokens: int  # tokens the request may still generate (per choice, times n)
    stream: bool

    @property
    def cost_tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones (any body reaches here)
        return "".join(p["text"] for p in content
                       if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _messages_text(messages: list[Any]) -> str:
    return "".join(f"{m.get('role', '')}\n{_content_text(m.get('content'))}\n"
                   for m in messages if isinstance(m, dict))


def prompt_text(body: dict[str, Any]) -> str:
    """The text the instance will see first: a completion prompt or the flattened messages
    (chat's ``messages``; Anthropic's ``system`` then ``messages``; Responses' ``instructions``
    then ``input``, a string or a list of items)."""
    # The system prompt of Messages and Responses comes first in the template, as chat's does.
    system = body.get("system", body.get("instructions"))
    system_text = _content_text(system)
    head = f"system\n{system_text}\n" if system_text else ""
    if "messages" in body and isinstance(body["messages"], list):
        return head + _messages_text(body["messages"])
    if "input" in body:  # Responses (an embeddings input has no items: no text)
        items = body["input"]
        if isinstance(items, str):
            return head + f"user\n{items}\n"
        return head + (_messages_text(items) if isinstance(items, list) else "")
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: its first prompt decides
    if isinstance(prompt, list):  # token ids: their decimal text shares prefixes as they do
        prompt = " ".join(map(str, prompt))
    return prompt if isinstance(prompt, str) else ""


def block_hashes(text: str, block_chars: int, max_blocks: int) -> tuple[bytes, ...]:
    """Chained 8-byte hashes of the leading full ``block_chars``-character blocks of ``text``."""
    hashes = []
    parent = b""
    for i in range(min(len(text) // block_chars, max_blocks)):
        block = text[i * block_chars:(i + 1) * block_chars].encode("utf-8", "surrogatepass")
        parent = hashlib.blake2b(parent + block, digest_size=8).digest()
        hashes.append(parent)
    return tuple(hashes)


def request_info(body: Any, block_chars: int, max_blocks: int) -> RequestInfo:
    """Routing facts of a parsed JSON body; a body the router cannot read gets empty facts (the
    instance will answer it with the proper 400)."""
    if not isinstance(body, dict):
        return RequestInfo((), 0, 0, False)
    text = prompt_text(body)
    n = body.get("n") if isinstance(body.get("n"), int) and body.get("n", 1) > 0 else 1
    max_tokens = body.get("max_completion_tokens",
                          body.get("max_tokens", body.get("max_output_tokens")))
    if not isinstance(max_tokens, int) or max_tokens < 0:
        max_tokens = _DEFAULT_MAX_TOKENS
    prompt_tokens = -(-len(text.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN)
    return RequestInfo(block_hashes(text, block_chars, max_blocks), prompt_tokens,
                       max_tokens * n, bool(body.get("stream")))
