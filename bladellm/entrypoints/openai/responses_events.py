"""A response's output items, built as text arrives, and the stream events that say so.

One builder serves both modes: a streamed response sends ``events`` as they come, a plain one
drops them and returns ``response``; so both carry the same items, and each streamed item's
``id`` is the one in ``response.completed``. Event order per item, as OpenAI sends it:
``output_item.added``, ``content_part.added``, the deltas, ``*.done``, ``content_part.done``,
``output_item.done`` (function calls: ``output_item.added``, ``function_call_arguments.delta``,
``function_call_arguments.done``, ``output_item.done``).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from bladellm.entrypoints.openai.protocol_responses import (
    FunctionCallOutput, IncompleteDetails, OutputItem, OutputMessage, OutputText,
    ReasoningOutput, ReasoningText, ResponseError, ResponseObject, ResponseUsage)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self.events: list[dict[str, Any]] = []  # not yet sent; the caller drains it
        self._seq = 0
        self._open: OutputItem | None = None  # the item text is being added to

    # ------------------------------------------------------------------------------ events

    def _emit(self, kind: str, **fields: Any) -> None:
        self.events.append({"type": kind, "sequence_number": self._seq, **fields})
        self._seq += 1

    def _where(self, item: OutputItem) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": self.response.output.index(item)}

    def _lifecycle(self, kind: str) -> None:
        self._emit(kind, response=self.response.model_dump(mode="json"))

    def start(self) -> None:
        self._lifecycle("response.created")
        self._lifecycle("response.in_progress")

    # ------------------------------------------------------------------------------- items

    def _add(self, item: OutputItem) -> None:
        self.close()
        self.response.output.append(item)
        self._open = item
        self._emit("response.output_item.added", output_index=len(self.response.output) - 1,
                   item=item.model_dump(mode="json"))

    def reasoning(self, delta: str) -> None:
        if not delta:
            return
        item = self._open
        if not isinstance(item, ReasoningOutput):
            item = ReasoningOutput(id=new_id("rs"), status="in_progress")
            self._add(item)
            item.content.append(ReasoningText(text=""))
            self._emit("response.content_part.added", **self._where(item), content_index=0,
                       part=item.content[0].model_dump(mode="json"))
        item.content[0].text += delta
        self._emit("response.reasoning_text.delta", **self._where(item), content_index=0,
                   delta=delta)

    def text(self, delta: str, force: bool = False,
             logprobs: list[dict[str, Any]] | None = None) -> None:
        """Answer text (and its tokens' logprobs, when asked for); ``force`` opens a message
        even for no text (an empty answer)."""
        if not delta and not force and not logprobs:
            return
        item = self._open
        if not isinstance(item, OutputMessage):
            item = OutputMessage(id=new_id("msg"), status="in_progress")
            self._add(item)
            item.content.append(OutputText(text=""))
            self._emit("response.content_part.added", **self._where(item), content_index=0,
                       part=item.content[0].model_dump(mode="json"))
        if delta or logprobs:
            item.content[0].text += delta
            item.content[0].logprobs.extend(logprobs or [])
            self._emit("response.output_text.delta", **self._where(item), content_index=0,
                       delta=delta, logprobs=logprobs or [])

    def call(self, call_id: str, name: str, arguments: str) -> None:
        """A new function call; its ``arguments`` so far (more may follow in ``arguments``)."""
        item = FunctionCallOutput(id=new_id("fc"), call_id=call_id, name=name, arguments="",
                                  status="in_progress")
        self._add(item)
        self.arguments(arguments)

    def arguments(self, delta: str) -> None:
        item = self._open
        if not delta or not isinstance(item, FunctionCallOutput):
            return
        item.arguments += delta
        self._emit("response.function_call_arguments.delta", **self._where(item), delta=delta)

    def close(self, status: str = "completed") -> None:
        """Finish the open item, if any, with its ``*.done`` events."""
        item, self._open = self._open, None
        if item is None:
            return
        where = self._where(item)
        if isinstance(item, ReasoningOutput):
            part = item.content[0]
            self._emit("response.reasoning_text.done", **where, content_index=0, text=part.text)
            self._emit("response.content_part.done", **where, content_index=0,
                       part=part.model_dump(mode="json"))
        elif isinstance(item, OutputMessage):
            part = item.content[0]
            self._emit("response.output_text.done", **where, content_index=0, text=part.text,
                       logprobs=part.logprobs)
            self._emit("response.content_part.done", **where, content_index=0,
                       part=part.model_dump(mode="json"))
        else:
            self._emit("response.function_call_arguments.done", **where, name=item.name,
                       arguments=item.arguments)
        item.status = status  # type: ignore[assignment]
        self._emit("response.output_item.done", output_index=where["output_index"],
                   item=item.model_dump(mode="json"))

    # ------------------------------------------------------------------------------ the end

    def finish(self, finish_reason: str | None, usage: ResponseUsage) -> None:
        """``response.completed``, or ``response.incomplete`` when cut by the token limit."""
        if not self.response.output:
            self.text("", force=True)  # the answer was empty: still a message, as chat's ""
        incomplete = finish_reason == "length"
        self.close("incomplete" if incomplete else "completed")
        resp = self.response
        resp.usage = usage
        resp.completed_at = int(time.time())
        if incomplete:
            resp.status = "incomplete"
            resp.incomplete_details = IncompleteDetails(reason="max_output_tokens")
            self._lifecycle("response.incomplete")
        else:
            resp.status = "completed"
            self._lifecycle("response.completed")

    def fail(self, message: str, code: str = "server_error") -> None:
        self.close("incomplete")
        self.response.status = "failed"
        self.response.error = ResponseError(code=code, message=message)
        self._lifecycle("response.failed")


def sse_event(event: dict[str, Any]) -> str:
    """One server-sent event as OpenAI sends them: the type as ``event:``, the JSON as data."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
