"""Structured output for reasoning models: the grammar applies to the answer, not the thinking.

A request served with a reasoning parser carries the end-of-thinking tag's token ids
(``GuidedDecodingParams.reasoning_end``; the API layer tokenizes the parser's tag, so this
layer knows nothing of parsers). Until the output has ended with that sequence, the grammar's
matcher is not fed and the mask allows every token; after it, the grammar constrains the rest.
``reasoning_start`` (a single token id, Qwen3's ``<think>``) makes the thinking optional: the
first output token may be it, opening the thinking, or any token the grammar allows, in which
case the grammar runs from the first token (a model that answers without thinking).

vLLM does the same with its structured-output manager asking the reasoning parser
``is_reasoning_end(token_ids)``; here the gate follows the tokens itself and can roll back
(rejected speculative tokens) across the end of the thinking.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Where the gate is: the first output token may open the thinking or start the answer; inside
# the thinking, waiting for the end sequence; open (the grammar sees every further token).
OPTIONAL, THINKING, OPEN = "optional", "thinking", "open"


@dataclass
class ReasoningGate:
    end_ids: list[int]
    start_id: int | None = None
    # Tokens the gate consumed (the thinking, its tags included); the grammar consumed the rest.
    history: list[int] = field(default_factory=list)
    state: str = ""

    def __post_init__(self) -> None:
        if not self.end_ids:
            raise ValueError("reasoning_end: must not be empty")
        if not self.state:
            self.state = self._state_of(self.history)

    def _state_of(self, history: list[int]) -> str:
        if not history:
            return OPTIONAL if self.start_id is not None else THINKING
        n = len(self.end_ids)
        if len(history) >= n and history[-n:] == self.end_ids:
            return OPEN
        return THINKING

    def refresh(self) -> None:
        """The state its tokens alone give (after the grammar's tokens were all rolled back)."""
        self.state = self._state_of(self.history)

    @property
    def is_open(self) -> bool:
        return self.state == OPEN

    def consume(self, token_ids: list[int]) -> int:
        """Take tokens while the thinking lasts; returns how many it took (the rest, if any,
        belongs to the answer and goes to the grammar)."""
        taken = 0
        for tok in token_ids:
            if self.state == OPEN:
                break
            if self.state == OPTIONAL and tok != self.start_id:
                self.state = OPEN  # answering without thinking: this token is the grammar's
                break
            self.history.append(tok)
            taken += 1
            self.state = self._state_of(self.history)
        return taken

    def rollback(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` tokens the gate took."""
        if num_tokens > len(self.history):
            raise RuntimeError(f"reasoning gate rollback of {num_tokens} tokens, "
                               f"only {len(self.history)} taken")
        if num_tokens:
            del self.history[len(self.history) - num_tokens:]
        self.refresh()

    def plan(self, draft: list[int]) -> tuple[list[str], int | None]:
        """The mask rows of one sampling step that verifies ``draft`` (row j: after j draft
        tokens), without changing the gate: the gate's state at each row before the answer
        starts (``OPTIONAL``: grammar mask plus the start token; ``THINKING``: anything), and
        the draft index from which the grammar takes over (``None``: not within this step)."""
        rows: list[str] = []
        state, history = self.state, list(self.history)
        for j in range(len(draft) + 1):
            if state == OPEN:
                return rows, j
            rows.append(state)
            if j == len(draft):
                break
            tok = draft[j]
            if state == OPTIONAL and tok != self.start_id:
                return rows, j  # the grammar takes draft[j:] (row j also allows the start)
            history.append(tok)
            state = self._state_of(history)
        return rows, None
