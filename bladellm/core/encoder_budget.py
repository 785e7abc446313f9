"""``--max_num_encoder_tokens_per_step``: how much vision-encoder work one step may start.

An image is encoded in the step whose chunk first reaches its placeholder tokens (or, for a
request just admitted, any image its chunk covers: a prompt-cache hit may end inside one); the
worker then keeps its features until the request's prefill has passed it, so later chunks
through the image cost the encoder nothing. A step grants images, in schedule order, until the
budget is spent; a request's chunk stops before the first image that would overspend it. An
image larger than the whole budget is granted when it is the step's first, so no request
waits forever.
"""

from __future__ import annotations

from bladellm.request import Request


class EncoderBudget:
    def __init__(self, max_tokens: int | None) -> None:
        self.max_tokens = max_tokens
        self.used = 0

    def cut(self, req: Request, start: int, num_new: int, just_admitted: bool) -> int:
        """Tokens of ``req``'s chunk of ``num_new`` from position ``start`` that fit; charges
        the images it starts."""
        if self.max_tokens is None or not req.mm_items:
            return num_new
        end = start + num_new
        for item in req.mm_items:  # in prompt order
            if item.end <= start or item.offset >= end:
                continue
            if item.offset < start and not just_admitted:
                continue  # started in an earlier step: its features are in the worker
            if self.used and self.used + item.length > self.max_tokens:
                return max(item.offset - start, 0)
            self.used += item.length
        return num_new
