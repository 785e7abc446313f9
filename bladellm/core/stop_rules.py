"""What a sampled token does to a request: appended, or the stop that finishes it (stop tokens,
EOS, length, a grammar's completion or rejection). Pure functions of the request; the
scheduler applies them to each step's tokens and counts what they appended."""

from __future__ import annotations

from collections.abc import Collection

from bladellm.errors import ErrorKind, failed_mid_output_error, unsatisfiable_error
from bladellm.request import Request, RequestStatus


def append_tokens(req: Request, token_ids: list[int], eos_token_ids: Collection[int],
                  max_model_len: int) -> list[int]:
    """Append sampled tokens one by one, stopping at the first that finishes the request."""
    appended = []
    grammar = req.grammar
    for token_id in token_ids:
        if grammar is not None and grammar.accept_tokens([token_id]) != 1:
            break  # the mask allowed it, so the matcher is in error: the caller fails it
        req.append_output_token_ids([token_id])
        appended.append(token_id)
        if grammar is not None and grammar.is_terminated() and grammar_stop(req):
            break
        if check_stop(req, token_id, eos_token_ids, max_model_len):
            break
    return appended


def grammar_rejection(req: Request, token_id: int) -> tuple[ErrorKind, str]:
    """The error of a request whose grammar rejected ``token_id``.

    When llguidance itself failed (the matcher is in its error state: ``try_consume_tokens``
    of a merely banned token leaves no error), the constraint is the cause: before any
    output, the grammar fails on its own whatever the model samples (``start: start``, an
    endless forced text); after some, it outgrew llguidance's limits (a right-recursive rule
    past 2000 Earley items). Either is the client's constraint: ``INVALID_GRAMMAR`` makes it
    a 400 naming the request field, with llguidance's advice. A banned token that
    got past the mask stays an engine failure (the mask and the matcher disagree).
    """
    reason = req.grammar.error  # type: ignore[union-attr]
    guided = req.sampling_params.guided_decoding
    if reason is not None and guided is not None:
        if req.num_output_tokens == 0:
            return ErrorKind.INVALID_GRAMMAR, unsatisfiable_error(guided.kind, reason)
        return ErrorKind.INVALID_GRAMMAR, failed_mid_output_error(guided.kind, reason,
                                                                  req.num_output_tokens)
    return ErrorKind.FAILED, (f"grammar: token {token_id} rejected "
                              f"({reason or 'not allowed by the grammar'})")


def grammar_stop(req: Request) -> bool:
    """The output is complete under its grammar: finish as a stop (EOS is implied)."""
    req.status = RequestStatus.FINISHED_STOPPED
    req.stop_reason = None
    req.grammar_complete = True
    return True


def check_stop(req: Request, token_id: int, eos_token_ids: Collection[int],
               max_model_len: int) -> bool:
    """Stop tokens first (they count only after ``min_tokens`` output tokens), then length."""
    params = req.sampling_params
    if req.num_output_tokens > params.min_tokens:
        if params.stop_token_ids and token_id in params.stop_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = token_id
            return True
        if not params.ignore_eos and token_id in eos_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = None
            return True
    if req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_model_len:
        req.status = RequestStatus.FINISHED_LENGTH
        return True
    return False
