"""The grammar of a reasoning model's request starts after the end-of-thinking token ids:
scripted token sequences through ``GrammarState`` and the batched bitmask (thinking rows allow
everything, the answer's rows are the grammar's), Qwen3's optional thinking (the first token may
open it), rollback across the end of the thinking, and speculative drafts that cross it."""

from __future__ import annotations

import numpy as np
import pytest

from bladellm.guided.backend import LLGuidanceBackend
from bladellm.guided.manager import GuidedDecodingManager
from bladellm.guided.reasoning_gate import OPEN, OPTIONAL, THINKING, ReasoningGate
from bladellm.sampling_params import GuidedDecodingParams as G
from tiny_models import train_tokenizer

REGEX = r"\d{3}-[a-c]{2}"


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="module")
def manager(tokenizer):
    backend = LLGuidanceBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    return GuidedDecodingManager(lambda: backend, len(tokenizer), 4, 8, 10.0)


def _enc(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def _state(manager, **kw):
    state = manager.grammar_for(G(regex=REGEX, **kw))
    state.future.result()
    assert state.is_ready()
    return state


def _grammar_row(manager, tokens=()):
    """The plain grammar's mask after ``tokens``."""
    ref = _state(manager)
    assert ref.accept_tokens(list(tokens)) == len(tokens)
    width = manager._bitmask.shape[1]
    return np.frombuffer(ref.matcher.compute_bitmask(), dtype=np.int32)[:width].copy()


def _rows(manager, state, draft=()):
    step = manager.start_bitmask([("r", state, list(draft))])
    return step.result().copy()


def test_plan_and_state_machine():
    gate = ReasoningGate([7, 8])
    assert gate.state == THINKING
    assert gate.plan([1, 7, 8, 5]) == ([THINKING] * 3, 3)
    assert gate.plan([7]) == ([THINKING] * 2, None)
    assert gate.consume([1, 7]) == 2 and gate.state == THINKING
    assert gate.consume([8, 5, 6]) == 1 and gate.is_open
    gate.rollback(1)
    assert gate.state == THINKING and gate.history == [1, 7]
    optional = ReasoningGate([8], start_id=3)
    assert optional.state == OPTIONAL
    assert optional.plan([5, 6]) == ([OPTIONAL], 0)  # answered at once: grammar from token 0
    assert optional.plan([3, 4, 8]) == ([OPTIONAL, THINKING, THINKING], 3)
    assert optional.consume([5]) == 0 and optional.state == OPEN
    with pytest.raises(ValueError):
        ReasoningGate([])


def test_grammar_waits_for_the_end_tag_then_constrains(manager, tokenizer):
    end = _enc(tokenizer, "</think>")
    assert len(end) > 1  # a multi-token tag is matched as a sequence
    state = _state(manager, reasoning_end=end)
    thinking = _enc(tokenizer, "hello world! how are you?")
    assert (_rows(manager, state)[0] == -1).all()  # anything goes while thinking
    assert state.accept_tokens(thinking) == len(thinking)  # not valid for the grammar: fine
    assert not state.is_terminated() and state.error is None
    assert state.accept_tokens(end[:-1]) == len(end) - 1
    assert (_rows(manager, state)[0] == -1).all()
    answer = _enc(tokenizer, "123-ab")
    # The tag's last token and the answer in one call (a speculative step accepts several).
    assert state.accept_tokens(end[-1:] + answer[:2]) == 3
    width = _grammar_row(manager).shape[0]
    assert np.array_equal(_rows(manager, state)[0][:width], _grammar_row(manager, answer[:2]))
    assert state.accept_tokens(answer[2:]) == len(answer) - 2
    assert state.is_terminated()
    # A token the grammar refuses after the thinking is refused.
    other = _state(manager, reasoning_end=end)
    assert other.accept_tokens(end + _enc(tokenizer, "x")) == len(end)


def test_rollback_reopens_the_thinking(manager, tokenizer):
    end = _enc(tokenizer, "</think>")
    state = _state(manager, reasoning_end=end)
    digits = _enc(tokenizer, "12")
    assert state.accept_tokens(end + digits) == len(end) + len(digits)
    state.rollback(len(digits) + 1)  # back inside the tag
    assert (_rows(manager, state)[0] == -1).all() and not state.is_terminated()
    assert state.accept_tokens(end[-1:] + _enc(tokenizer, "123-ab")) == \
        1 + len(_enc(tokenizer, "123-ab"))
    assert state.is_terminated()


def test_optional_thinking_first_token(manager, tokenizer):
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")  # a special token: never grammar's
    end = [tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    answering = _state(manager, reasoning_end=end, reasoning_start=start)
    row = _rows(manager, answering)[0]
    plain = _grammar_row(manager)
    words = row.view(np.uint32)
    assert words[start // 32] & (1 << (start % 32))  # the thinking may open here...
    words = words.copy()
    words[start // 32] &= ~np.uint32(1 << (start % 32))
    assert np.array_equal(words[:plain.shape[0]].view(np.int32), plain)  # ...or the answer
    answer = _enc(tokenizer, "123-ab")
    assert answering.accept_tokens(answer) == len(answer) and answering.is_terminated()

    thinking = _state(manager, reasoning_end=end, reasoning_start=start)
    hmm = _enc(tokenizer, "hmm, ok")
    assert thinking.accept_tokens([start] + hmm) == 1 + len(hmm)
    assert (_rows(manager, thinking)[0] == -1).all()
    assert thinking.accept_tokens(end + answer) == len(end) + len(answer)
    assert thinking.is_terminated()
    thinking.rollback(len(answer) + len(end) + 1 + len(hmm))  # all the way back to the first token
    assert thinking.gate.state == OPTIONAL


def test_speculative_rows_across_the_end_of_the_thinking(manager, tokenizer):
    end = _enc(tokenizer, "</think>")
    state = _state(manager, reasoning_end=end)
    state.accept_tokens(_enc(tokenizer, "fine"))
    answer = _enc(tokenizer, "12")
    draft = end + answer
    rows = _rows(manager, state, draft)
    assert rows.shape[0] == 1 + len(draft)
    assert (rows[:len(end)] == -1).all()  # before the tag's last token: thinking
    width = _grammar_row(manager).shape[0]
    for j in range(len(answer) + 1):
        assert np.array_equal(rows[len(end) + j][:width], _grammar_row(manager, answer[:j])), j
    # The state is unchanged by the fill.
    assert state.gate.state == THINKING and state.accept_tokens(draft) == len(draft)

    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    optional = _state(manager, reasoning_end=end, reasoning_start=start)
    rows = _rows(manager, optional, [start] + _enc(tokenizer, "ok"))
    assert rows[0].view(np.uint32)[start // 32] & (1 << (start % 32))
    assert (rows[1:] == -1).all()


def test_rejected_answer_draft_leaves_the_thinking_optional(manager, tokenizer):
    """A speculative draft that starts answering, then is rejected whole, must not close the
    optional thinking: the target's own next token may still be the start tag."""
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    end = [tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    state = _state(manager, reasoning_end=end, reasoning_start=start)
    draft = _enc(tokenizer, "12")
    assert state.accept_tokens(draft) == len(draft) and state.gate.state == OPEN
    state.rollback(len(draft))
    assert state.gate.state == OPTIONAL
    hmm = _enc(tokenizer, "hmm")
    assert state.accept_tokens([start] + hmm) == 1 + len(hmm)  # the thinking opens after all
    assert state.gate.state == THINKING
