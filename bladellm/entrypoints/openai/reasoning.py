"""Reasoning parsers (``--reasoning_parser``): split a reasoning model's thinking from its answer.

Both supported families mark the thinking with ``<think>…</think>``; they differ in who opens it:

- ``deepseek_r1``: the chat template opens ``<think>`` in the prompt, so everything the model
  writes before ``</think>`` is reasoning, whether or not it repeats the start tag; output that
  never closes the tag is all reasoning (the answer is empty).
- ``qwen3``: the model opens ``<think>`` itself; only output that starts with ``<think>`` has a
  reasoning part. With ``chat_template_kwargs: {"enable_thinking": false}`` the template closes an
  empty think block in the prompt, the model writes no tags, and all of its output is the answer.

The start tag is recognised only at the head of the output (after leading whitespace): that is
where both families put it, and it lets a stream decide at once instead of holding text back.
Newlines between a tag and the text next to it are layout, not content: they are dropped (as the
Qwen3 and DeepSeek templates do when they render an earlier turn's reasoning), so the answer of
``<think>\\nhmm\\n</think>\\n\\nHi`` is ``Hi`` and its reasoning ``hmm``.

``ReasoningParser.split`` is the non-streaming form; ``ReasoningParser.streamer`` returns a
``ReasoningStream`` that yields the same split as deltas: a tag (or the newlines next to one)
split across deltas is held back until it is decided, never leaked into either part. ``split``
runs the same state machine, so streaming and non-streaming results agree by construction.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

START_TAG = "<think>"
END_TAG = "</think>"

# Where the stream is: deciding whether the output opens with the start tag; inside the
# reasoning; between the end tag and the answer's first character; in the answer.
_HEAD, _REASONING, _ANSWER_HEAD, _ANSWER = range(4)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass(frozen=True)
class ReasoningParser:
    """One family's convention. ``opened_by_prompt``: the template opens the think block, so
    output before the end tag is reasoning even without a start tag (deepseek_r1)."""

    name: str
    opened_by_prompt: bool
    start_tag: str = START_TAG
    end_tag: str = END_TAG
    # The prompt already closed the think block (Qwen3 with enable_thinking false renders
    # "<think>\n\n</think>\n\n" at its end): all output is the answer.
    closed_by_prompt: bool = False

    def for_prompt(self, prompt: str) -> "ReasoningParser":
        """This parser as it applies to output following ``prompt`` (the rendered chat
        template): a prompt ending with the end tag leaves no thinking to the output; one
        ending with the start tag (DeepSeek-R1, Qwen3-Thinking-2507 templates) opened it."""
        tail = prompt.rstrip()
        if tail.endswith(self.end_tag):
            return replace(self, opened_by_prompt=False, closed_by_prompt=True)
        if tail.endswith(self.start_tag):
            return replace(self, opened_by_prompt=True, closed_by_prompt=False)
        return self

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, answer) of a whole output; reasoning is None when there is none."""
        stream = self.streamer()
        reasoning, answer = stream.feed(text)
        r_tail, a_tail = stream.finish()
        reasoning += r_tail
        answer += a_tail
        return (reasoning or None), answer

    def streamer(self) -> "ReasoningStream":
        """A fresh incremental splitter for one output."""
        return ReasoningStream(self)


class ReasoningStream:
    """Incremental ``split``: ``feed`` each text delta, then ``finish`` once."""

    def __init__(self, parser: ReasoningParser) -> None:
        self._parser = parser
        self._state = _ANSWER if parser.closed_by_prompt else _HEAD
        self._pending = ""  # text received but not yet assigned (a possible tag or newlines)
        self._reasoning_started = False  # a non-newline reasoning character was emitted
        self._finished = False

    @property
    def in_reasoning(self) -> bool:
        """Whether text fed now would be reasoning (the answer has not begun)."""
        if self._state == _HEAD:
            return self._parser.opened_by_prompt
        return self._state == _REASONING

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning delta, answer delta) that ``delta`` completes."""
        if self._finished:
            raise RuntimeError("ReasoningStream.feed after finish")
        self._pending += delta
        reasoning: list[str] = []
        answer: list[str] = []
        self._advance(reasoning, answer, final=False)
        return "".join(reasoning), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """Flush what was held back: the output ended, so a partial tag is plain text."""
        if self._finished:
            return "", ""
        reasoning: list[str] = []
        answer: list[str] = []
        self._advance(reasoning, answer, final=True)
        self._finished = True
        return "".join(reasoning), "".join(answer)

    # ------------------------------------------------------------------ state machine

    def _advance(self, reasoning: list[str], answer: list[str], *, final: bool) -> None:
        p = self._parser
        while True:
            if self._state == _HEAD:
                head = self._pending.lstrip()
                if head.startswith(p.start_tag):
                    self._pending = head[len(p.start_tag):]
                    self._state = _REASONING
                elif p.start_tag.startswith(head) and not final:
                    return  # still could be the start tag (or only whitespace so far)
                else:
                    self._state = _REASONING if p.opened_by_prompt else _ANSWER
                    if p.opened_by_prompt:
                        self._pending = head
            elif self._state == _REASONING:
                text = self._pending
                if not self._reasoning_started:
                    text = text.lstrip("\n")
                end = text.find(p.end_tag)
                if end >= 0:
                    self._emit_reasoning(text[:end].rstrip("\n"), reasoning)
                    self._pending = text[end + len(p.end_tag):]
                    self._state = _ANSWER_HEAD
                    continue
                if final:
                    # Truncated thinking: a trailing partial tag is text; trailing newlines
                    # are still layout.
                    self._emit_reasoning(text.rstrip("\n"), reasoning)
                    self._pending = ""
                    return
                keep = _partial_suffix(text, p.end_tag)
                body = text[:len(text) - keep]
                stripped = body.rstrip("\n")
                # Trailing newlines wait: they are layout if the end tag follows them.
                self._emit_reasoning(stripped, reasoning)
                self._pending = text[len(stripped):]
                return
            elif self._state == _ANSWER_HEAD:
                text = self._pending.lstrip()
                if not text:
                    self._pending = ""
                    return
                self._pending = text
                self._state = _ANSWER
            else:
                if self._pending:
                    answer.append(self._pending)
                    self._pending = ""
                return

    def _emit_reasoning(self, text: str, out: list[str]) -> None:
        if text:
            out.append(text)
            self._reasoning_started = True


_PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", opened_by_prompt=True),
    "qwen3": ReasoningParser("qwen3", opened_by_prompt=False),
}
REASONING_PARSERS = tuple(_PARSERS)


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser called ``name`` (None: no reasoning parsing); ValueError for an unknown one."""
    if name is None:
        return None
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(f"--reasoning_parser: unknown parser {name!r}; "
                         f"choose one of {', '.join(REASONING_PARSERS)}") from None
