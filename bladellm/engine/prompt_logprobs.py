"""The engine core's side of prompt logprobs: the runner computes them from each prefill chunk
of the request's own prefill (``ModelRunner._prompt_logprobs``); they are gathered here and sent
once, whole, with the request's first output (the one that carries its first token).

A prompt recomputed after preemption yields its positions again: those already held are
skipped, and nothing more is taken once they were sent.
"""

from __future__ import annotations

from bladellm.core.outputs import EngineCoreOutput, Logprobs


class PromptLogprobs:
    def __init__(self) -> None:
        self._held: dict[str, Logprobs] = {}  # request id -> prompt tokens 1.. so far

    def expect(self, request_id: str) -> None:
        """``request_id`` wants prompt logprobs (a one-token prompt gets none: sent empty)."""
        self._held[request_id] = Logprobs([], [], [])

    def add(self, request_id: str, chunk: Logprobs, start: int) -> None:
        """``chunk``: prompt tokens ``start + 1`` on, from a prefill chunk that began at
        position ``start``."""
        held = self._held.get(request_id)
        if held is None:  # sent already (a recompute after preemption) or aborted
            return
        skip = len(held.ranks) - start  # positions already held
        if skip < 0:
            raise RuntimeError(f"prompt logprobs of {request_id}: positions "
                               f"{len(held.ranks) + 1}..{start} were never computed")
        held.token_ids.extend(chunk.token_ids[skip:])
        held.logprobs.extend(chunk.logprobs[skip:])
        held.ranks.extend(chunk.ranks[skip:])

    def attach(self, outputs: list[EngineCoreOutput]) -> None:
        """Put each request's prompt logprobs on its first output with a token (and forget
        any request that finished)."""
        for out in outputs:
            if out.request_id not in self._held:
                continue
            if out.new_token_ids:
                out.prompt_logprobs = self._held.pop(out.request_id)
            elif out.finish_reason is not None:
                del self._held[out.request_id]

    def drop(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._held.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._held)
