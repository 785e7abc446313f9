"""What a finished generation becomes in Anthropic's terms: content blocks (thinking, text,
tool_use with its parsed ``input``), ``stop_reason`` and ``usage``. The tool-call parsing is the
chat path's (``tool_calls.py``); only the shapes are Anthropic's."""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from typing import Any

from bladellm.entrypoints.anthropic.protocol import ThinkingOut, TextOut, ToolUseOut, Usage
from bladellm.entrypoints.openai.reasoning import ReasoningParser
from bladellm.entrypoints.openai.serving_common import UsageCounter
from bladellm.entrypoints.openai.tool_calls import ToolChoice, forced_calls, parse_auto


@dataclass(frozen=True)
class OutputShape:
    """How one request's output becomes blocks."""

    tools: ToolChoice | None
    reasoning: ReasoningParser | None  # --reasoning_parser, adapted to the prompt
    omit_thinking: bool = False  # thinking.display "omitted": the block without its text
    context_bound: bool = False  # max_tokens was lowered to the room the context leaves


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def thinking_signature(thinking: str) -> str:
    """The ``signature`` the SDK expects on a thinking block. Anthropic's is an opaque token
    it checks when the block comes back; this server drops earlier turns' thinking instead
    (as Anthropic does from the context), so a digest of the text serves."""
    return hashlib.sha256(thinking.encode("utf-8")).hexdigest()


def call_input(call: dict[str, Any]) -> dict[str, Any] | None:
    """A chat tool call's arguments as a tool_use ``input``; None when they are not a complete
    JSON object (a call cut by max_tokens)."""
    try:
        value = json.loads(call["function"]["arguments"])
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def message_blocks(text: str, shape: OutputShape) -> list[ThinkingOut | TextOut | ToolUseOut]:
    """The whole output's blocks: its thinking (with ``--reasoning_parser``), then the answer."""
    if shape.reasoning is None:
        return list(answer_blocks(text, shape.tools))
    thinking, answer = shape.reasoning.split(text)
    blocks: list[Any] = []
    if thinking:
        blocks.append(ThinkingOut(thinking="" if shape.omit_thinking else thinking,
                                  signature=thinking_signature(thinking)))
    return blocks + answer_blocks(answer, shape.tools)


def answer_blocks(text: str, tools: ToolChoice | None) -> list[TextOut | ToolUseOut]:
    """The answer's blocks: its text, or the tool calls found in / forced into it."""
    calls: list[dict[str, Any]] = []
    content: str | None = text
    if tools is not None and tools.mode in ("named", "required"):
        calls = forced_calls(tools, text)
    elif tools is not None and tools.mode == "auto":
        content, calls = parse_auto(text, tools.names)
        calls = calls if tools.parallel else calls[:1]
    uses = []
    for call in calls:
        args = call_input(call)
        if args is None:  # incomplete: the client gets the text the model wrote
            return [TextOut(text=text)] if text else []
        uses.append(ToolUseOut(id=tool_use_id(), name=call["function"]["name"], input=args))
    if uses and tools is not None and tools.mode in ("named", "required"):
        content = None  # the forced JSON itself is the call, not text
    return ([TextOut(text=content)] if content else []) + uses


def stop_reason(finish: str | None, stop: int | str | None, called: bool,
                context_bound: bool = False) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from the engine's finish reason and stop string / token;
    ``context_bound``: the length limit was the context's, not the client's ``max_tokens``."""
    if finish == "length":
        return ("model_context_window_exceeded" if context_bound else "max_tokens"), None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return ("tool_use" if called else "end_turn"), None


def usage(counter: UsageCounter) -> Usage:
    prompt = sum(counter.prompt_tokens.values())
    cached = min(sum(counter.cached_tokens.values()), prompt)
    return Usage(input_tokens=prompt - cached, cache_read_input_tokens=cached,
                 output_tokens=counter.completion_tokens)
