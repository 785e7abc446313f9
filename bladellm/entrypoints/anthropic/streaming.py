"""``stream: true`` on /v1/messages: Anthropic's server-sent events, each with its ``event:``
line: ``message_start``, ``ping``, then per content block ``content_block_start``,
``content_block_delta`` (``text_delta``, ``thinking_delta`` + ``signature_delta``,
``input_json_delta``) and ``content_block_stop``, then ``message_delta`` (stop reason,
cumulative usage) and ``message_stop``. A failure mid-stream is an ``error`` event.

Tool calls stream as the chat path finds them: a forced call (``tool_choice`` tool) streams its
JSON input as it is generated; calls the model writes on its own (auto) are held back from the
text and sent whole once parsed; ``any`` sends its calls at the end.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from bladellm.http.anthropic_errors import from_api_error
from bladellm.entrypoints.anthropic.output import (
    OutputShape, call_input, stop_reason, thinking_signature, tool_use_id, usage)
from bladellm.entrypoints.openai.serving_common import UsageCounter, check_output
from bladellm.entrypoints.openai.tool_calls import AutoToolStream, ToolChoice, forced_calls
from bladellm.http.handlers import from_exception

PING_INTERVAL = 10.0  # seconds without an event before a keep-alive ping (proxies time out)


def event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


PING = event("ping", {"type": "ping"})


class Blocks:
    """The message's content blocks as events: numbered in order, one open at a time."""

    def __init__(self, omit_thinking: bool = False) -> None:
        self.omit_thinking = omit_thinking  # thinking blocks carry their signature only
        self.index = -1
        self.open: str | None = None  # the open block's type
        self.thinking: list[str] = []  # the open thinking block's text (for its signature)
        self.num_tool_uses = 0

    def _start(self, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index += 1
        self.open = block["type"]
        self.num_tool_uses += block["type"] == "tool_use"
        return events + [event("content_block_start", {
            "type": "content_block_start", "index": self.index, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta",
                     {"type": "content_block_delta", "index": self.index, "delta": delta})

    def close(self) -> list[str]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":
            events.append(self._delta({"type": "signature_delta",
                                       "signature": thinking_signature("".join(self.thinking))}))
            self.thinking = []
        self.open = None
        return events + [event("content_block_stop",
                               {"type": "content_block_stop", "index": self.index})]

    def text(self, delta: str) -> list[str]:
        if not delta:
            return []
        events = self._start({"type": "text", "text": ""}) if self.open != "text" else []
        return events + [self._delta({"type": "text_delta", "text": delta})]

    def thinking_text(self, delta: str) -> list[str]:
        if not delta:
            return []
        events = [] if self.open == "thinking" else \
            self._start({"type": "thinking", "thinking": "", "signature": ""})
        self.thinking.append(delta)
        if self.omit_thinking:
            return events
        return events + [self._delta({"type": "thinking_delta", "thinking": delta})]

    def tool_use(self, name: str, partial_json: str, new: bool = False) -> list[str]:
        """More of a tool call's JSON input; ``new`` (or no tool_use block open) starts one."""
        events = []
        if new or self.open != "tool_use":
            events = self._start({"type": "tool_use", "id": tool_use_id(), "name": name,
                                  "input": {}})
        if partial_json:
            events.append(self._delta({"type": "input_json_delta",
                                       "partial_json": partial_json}))
        return events


class AnswerStream:
    """The answer's text as blocks, by ``tool_choice`` mode (see the module docstring)."""

    def __init__(self, tools: ToolChoice | None, blocks: Blocks) -> None:
        self.mode = "none" if tools is None else tools.mode
        self.tools = tools
        self.blocks = blocks
        self.auto = AutoToolStream(tools.names) if tools is not None else None
        self.held: list[str] = []  # mode "required": the JSON array of calls

    def feed(self, text: str) -> list[str]:
        if self.mode == "auto":
            return self.blocks.text(self.auto.feed(text))  # type: ignore[union-attr]
        if self.mode == "named":
            return self.blocks.tool_use(self.tools.name, text) if text else []  # type: ignore
        if self.mode == "required":
            self.held.append(text)
            return []
        return self.blocks.text(text)

    def finish(self) -> list[str]:
        if self.mode == "auto":
            rest, calls = self.auto.finish()  # type: ignore[union-attr]
            calls = calls if self.tools.parallel else calls[:1]  # type: ignore[union-attr]
            return self.blocks.text(rest) + self._whole(calls)
        if self.mode == "required":
            text = "".join(self.held)
            calls = forced_calls(self.tools, text)  # type: ignore[arg-type]
            return self._whole(calls) if calls else self.blocks.text(text)
        return []

    def _whole(self, calls: list[dict[str, Any]]) -> list[str]:
        events = []
        for call in calls:
            args = call_input(call) or {}
            events += self.blocks.tool_use(call["function"]["name"], json.dumps(args), new=True)
        return events


class OutputStream:
    """A generation's deltas as events: the thinking (``--reasoning_parser``), then the
    answer."""

    def __init__(self, shape: OutputShape) -> None:
        self.blocks = Blocks(shape.omit_thinking)
        self.answer = AnswerStream(shape.tools, self.blocks)
        self.reasoning = shape.reasoning.streamer() if shape.reasoning is not None else None

    def feed(self, text: str) -> list[str]:
        if self.reasoning is None:
            return self.answer.feed(text)
        thinking, answer = self.reasoning.feed(text)
        return self.blocks.thinking_text(thinking) + self.answer.feed(answer)

    def finish(self) -> list[str]:
        events = []
        if self.reasoning is not None:
            thinking, answer = self.reasoning.finish()
            events = self.blocks.thinking_text(thinking) + self.answer.feed(answer)
        return events + self.answer.finish() + self.blocks.close()


async def message_events(message_id: str, model: str, first: Any, merged: Any,
                         shape: OutputShape) -> AsyncIterator[str]:
    """The event stream of one message; ``first``: the engine's first output, awaited before
    the response started (so that a request the engine refuses still gets its 4xx)."""
    counter = UsageCounter()
    output = OutputStream(shape)
    finish, stop = None, None
    pending: asyncio.Future | None = None
    try:
        item = first
        counter.add(0, first[1])
        yield event("message_start", {"type": "message_start", "message": {
            "id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": usage(counter).model_dump()}})
        yield PING
        while True:
            _, out = item
            check_output(out)
            if item is not first:
                counter.add(0, out)
            comp = out.outputs[0]
            for e in output.feed(comp.text):
                yield e
            if comp.finish_reason is not None:
                finish, stop = comp.finish_reason, comp.stop_reason
            pending = asyncio.ensure_future(anext(merged))
            while not (await asyncio.wait({pending}, timeout=PING_INTERVAL))[0]:
                yield PING
            try:
                item = pending.result()
            except StopAsyncIteration:
                break
            finally:
                pending = None
        for e in output.finish():
            yield e
        reason, sequence = stop_reason(finish, stop, output.blocks.num_tool_uses > 0,
                                       shape.context_bound)
        yield event("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                      "usage": usage(counter).model_dump()})
        yield event("message_stop", {"type": "message_stop"})
    except Exception as exc:  # noqa: BLE001 - mid-stream failure: tell the client in-band
        _, body = from_api_error(from_exception(exc))
        yield event("error", body)
    finally:
        if pending is not None:
            pending.cancel()
            # Not gather(): a cancelled wait must not cancel the task again mid-cleanup.
            await asyncio.wait({pending})
        try:
            await merged.aclose()  # aborts the engine request if it is still running
        except RuntimeError:
            pass  # still closing in the cancelled task, which aborts it
