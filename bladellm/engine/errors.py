"""Typed errors the front end maps to HTTP status codes."""

from bladellm.core.outputs import GRAMMAR_ERROR_PREFIX, QUEUE_TIMEOUT_ERROR


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


def request_error(error: str) -> Exception:
    """The exception for an engine-side request error string (``EngineCoreOutput.error``): a
    queue timeout is an overload (503), the client's failing constraint a ValueError (400
    naming its field), anything else ``RequestFailedError`` (500)."""
    if error == QUEUE_TIMEOUT_ERROR:
        return EngineOverloadedError("request waited longer than --max_queue_time")
    if error.startswith(GRAMMAR_ERROR_PREFIX):
        return ValueError(error[len(GRAMMAR_ERROR_PREFIX):])
    return RequestFailedError(error)
