"""The engine's typed errors, which the front ends map to HTTP status codes, and the kind of
a request's error as it travels on the engine's outputs.

The lowest layer: imported by ``core/`` (the outputs carry ``ErrorKind``), the engine, the servers
and the router alike, so it imports nothing of BladeLLM and no torch.
"""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    """Why a request failed inside the engine (``EngineCoreOutput.error_kind``): the front ends
    pick the exception, hence the HTTP status, from it; the message says what happened."""

    QUEUE_TIMEOUT = "queue_timeout"  # waited past --max_queue_time: an overload (503)
    INVALID_GRAMMAR = "invalid_grammar"  # the client's constraint cannot be followed (400)
    FAILED = "failed"  # the engine failed the request (500)


class EngineDeadError(RuntimeError):
    """The engine core died; every pending and future request fails with this (HTTP 503)."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full or a request waited past --max_queue_time (HTTP 503 + Retry-After)."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine; the engine keeps serving (HTTP 500)."""


class ServerShuttingDownError(RuntimeError):
    """The server is stopping and the request did not finish within --shutdown_timeout
    (HTTP 503: the client may retry on another replica)."""


class ContextLengthError(ValueError):
    """The prompt, or the prompt plus ``max_tokens``, does not fit in the model's context (a 400).

    Carries the numbers so the front end can name the field the client sent (``prompt`` or
    ``messages``; ``max_tokens`` or ``max_completion_tokens``)."""

    def __init__(self, message: str, *, num_prompt_tokens: int, max_tokens: int | None,
                 max_model_len: int) -> None:
        super().__init__(message)
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len

    def __reduce__(self):  # picklable (Ray, process boundaries) despite keyword-only fields
        return _context_length_error, (str(self), self.num_prompt_tokens, self.max_tokens,
                                       self.max_model_len)

    @property
    def prompt_overflows(self) -> bool:
        """True when the prompt alone leaves no room for a single output token."""
        return self.num_prompt_tokens >= self.max_model_len


def _context_length_error(message: str, num_prompt_tokens: int, max_tokens: int | None,
                          max_model_len: int) -> ContextLengthError:
    return ContextLengthError(message, num_prompt_tokens=num_prompt_tokens,
                              max_tokens=max_tokens, max_model_len=max_model_len)


def request_error(kind: ErrorKind | None, message: str) -> Exception:
    """The exception for a request the engine failed (``EngineCoreOutput.error_kind`` and
    ``.error``): a queue timeout is an overload (503), the client's failing constraint a
    ValueError (400 naming its field), anything else ``RequestFailedError`` (500)."""
    if kind is ErrorKind.QUEUE_TIMEOUT:
        return EngineOverloadedError("request waited longer than --max_queue_time")
    if kind is ErrorKind.INVALID_GRAMMAR:
        return ValueError(message)
    return RequestFailedError(message)


# ---- messages of a structured-output constraint that fails (ErrorKind.INVALID_GRAMMAR) --------
# Here, not in guided/, because the scheduler (core/) words them when a matcher gives up.

# The request field each constraint kind came from.
FIELD_OF_KIND = {"json": "guided_json", "json_object": "response_format", "regex": "guided_regex",
                 "choice": "guided_choice", "grammar": "guided_grammar"}


def llguidance_reason(error: str) -> str:
    """llguidance's error text without the marker it adds when ``verbose_errors`` is off."""
    return error.replace("<non-verbose/>", "").strip()


def unsatisfiable_error(kind: str, reason: str) -> str:
    """The message of a constraint that fails at its first token (the client's fault: a 400)."""
    return (f"{FIELD_OF_KIND[kind]}: no output can satisfy the {kind} constraint (it fails at "
            f"the first token: {llguidance_reason(reason)})")


def failed_mid_output_error(kind: str, reason: str, num_output_tokens: int) -> str:
    """The message of a constraint that llguidance could not follow further after some output,
    e.g. a right-recursive rule past its parser's 2000-item row limit: the constraint's doing
    (the message says how to rewrite it), so a 400 as well."""
    return (f"{FIELD_OF_KIND[kind]}: the {kind} constraint failed after {num_output_tokens} "
            f"output tokens: {llguidance_reason(reason)}")
