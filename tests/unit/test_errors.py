"""``request_error``: the kind of a request's engine error, not its text, picks the exception the
front ends turn into a status code."""

from __future__ import annotations

import pickle

from bladellm.errors import (ContextLengthError, EngineOverloadedError, ErrorKind,
                             RequestFailedError, request_error)


def test_queue_timeout_is_an_overload():
    error = request_error(ErrorKind.QUEUE_TIMEOUT, "queue_timeout")
    assert isinstance(error, EngineOverloadedError)
    assert str(error) == "request waited longer than --max_queue_time"


def test_invalid_grammar_is_the_clients_error_with_its_message():
    error = request_error(ErrorKind.INVALID_GRAMMAR, "guided_grammar: no output can satisfy")
    assert type(error) is ValueError and str(error) == "guided_grammar: no output can satisfy"


def test_other_failures_are_the_engines():
    for kind in (ErrorKind.FAILED, None):
        # A message that reads like a grammar error changes nothing: only the kind counts.
        error = request_error(kind, "invalid grammar: boom")
        assert type(error) is RequestFailedError and str(error) == "invalid grammar: boom"


def test_context_length_error_survives_pickling():
    error = ContextLengthError("too long", num_prompt_tokens=9, max_tokens=4, max_model_len=10)
    back = pickle.loads(pickle.dumps(error))
    assert (str(back), back.num_prompt_tokens, back.max_tokens, back.max_model_len,
            back.prompt_overflows) == ("too long", 9, 4, 10, False)
