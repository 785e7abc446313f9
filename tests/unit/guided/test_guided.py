"""bladellm.guided without a model: constraint → grammar, ASCII regex classes, validation, the
compiled-grammar cache, matcher state (accept several tokens, rollback, termination), the
batched bitmask and applying it to logits."""

from __future__ import annotations

import re
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from bladellm.guided.backend import GrammarError, LLGuidanceBackend, validate
from bladellm.guided.bitmask import apply_token_bitmask, unpack_bitmask
from bladellm.guided.cache import CompiledGrammarCache
from bladellm.guided.grammar import ascii_regex, cache_key, to_grammar
from bladellm.guided.manager import GuidedDecodingManager
from bladellm.kernels import resolve_kernels
from bladellm.sampling_params import GuidedDecodingParams as G
from bladellm.sampling_params import SamplingParams
from tiny_models import train_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="module")
def backend(tokenizer):
    return LLGuidanceBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


@pytest.mark.parametrize("pattern,ascii_pattern", [
    (r"\d+", "[0-9]+"), (r"[\d.]+", "[0-9.]+"), (r"\D", "[^0-9]"), (r"\w", "[0-9A-Za-z_]"),
    (r"\\d", r"\\d"), (r"[]\d]", "[]0-9]"), (r"a\.b", r"a\.b"), (r"[^\s]", r"[^ \t\n\r\f\v]"),
])
def test_ascii_regex(pattern, ascii_pattern):
    assert ascii_regex(pattern) == ascii_pattern


def test_params_validation_and_normalisation():
    a = G(json={"b": 1, "a": {"type": "string"}})
    b = G(json='{ "b" : 1, "a": {"type": "string"} }')
    assert a.json == b.json == '{"b":1,"a":{"type":"string"}}'  # key order kept
    assert cache_key(a) == cache_key(b) != cache_key(G(json={"a": {"type": "string"}, "b": 1}))
    assert cache_key(G(json={"type": "object"})) != cache_key(G(json_object=True))
    with pytest.raises(ValueError, match="exactly one"):
        G()
    with pytest.raises(ValueError, match="exactly one"):
        G(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, guided_decoding=G(regex="a+"))


@pytest.mark.parametrize("params,words", [
    (G(json={"type": "foo"}), "guided_json"), (G(regex="[a-"), "guided_regex"),
    (G(grammar="start: x"), "guided_grammar"), (G(grammar="root ::= [a-"), "guided_grammar"),
])
def test_validate_names_the_field(params, words):
    with pytest.raises(GrammarError, match=words):
        validate(params)


def _encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def _byte_matcher(params):
    """A matcher for ``params`` over one token per byte: exact languages are easy to check."""
    import llguidance

    from bladellm.guided.backend import _byte_tokenizer

    matcher = llguidance.LLMatcher(_byte_tokenizer(), to_grammar(params), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher


def _matches(params, text: str) -> bool:
    matcher = _byte_matcher(params)
    data = list(text.encode())
    return (matcher.try_consume_tokens(data) == len(data) and matcher.is_accepting()
            and not matcher.is_error())


# Regex metacharacters, quotes, backslashes, newlines, non-ASCII (astral too), a '/' (Lark's
# regex delimiter) and an option that is a prefix of others.
CHOICES = ["a", "ab", "a.b", "(x|y)", "[z]", r"\d+", 'say "hi"', "it's", "new\nline", "tab\t",
           "ünï😀", "a/b", "^$", "{1,2}", " sp ", "#c", "a-b", "~&*?"]
NOT_CHOICES = ["", "abc", "axb", "x", "y", "z", "5", "55", r"\d", "say", "new", "newline",
               "ünï", "😀", " sp", "b", "ab ", "aa", "\\", r"a\.b", "sp"]


def test_choice_matches_exactly_its_options():
    params = G(choice=CHOICES)
    assert [c for c in CHOICES if not _matches(params, c)] == []
    assert [t for t in NOT_CHOICES if _matches(params, t)] == []


@pytest.mark.parametrize("num_choices", [1999, 2000, 10_000])
def test_thousands_of_choices_work_with_a_real_tokenizer(backend, tokenizer, num_choices):
    # Each choice used to be a parser-level alternative: 2000 or more overflowed llguidance's
    # Earley row (max_items_in_row) at the first token.
    choices = [f"option {i}" for i in range(num_choices)]
    validate(G(choice=choices))
    for text in (choices[-1], choices[num_choices // 2], "option 4"):
        matcher = backend.compile(G(choice=choices))
        matcher.compute_bitmask()
        tokens = _encode(tokenizer, text)
        assert matcher.try_consume_tokens(tokens) == len(tokens), matcher.get_error()
        assert matcher.is_accepting() and not matcher.is_error()
    assert not _matches(G(choice=choices), f"option {num_choices}")


@pytest.mark.parametrize("grammar,reason", [
    ("start: start", "NoExtensionBias"),  # no sentence at all
    ('root ::= "a" root', "Too many items"),  # GBNF: an endless forced "aaa..."
    ('start: "ab" start', "Too many items"),
    # A user grammar with parser-level alternatives past llguidance's Earley row limit.
    pytest.param("start: " + " | ".join(f'"o{i}"' for i in range(2000)), "max is 2000",
                 id="2000-alternatives"),
])
def test_grammar_failing_at_the_first_token_is_invalid(grammar, reason):
    with pytest.raises(GrammarError, match=r"^guided_grammar: no output can satisfy the grammar "
                                           rf"constraint \(it fails at the first token: .*{reason}"):
        validate(G(grammar=grammar))


@pytest.mark.parametrize("grammar", [
    'start: "a"+', 'root ::= "a" | "b" root', 'start: ""',
    # Only forced text is tried: the good branch "x" keeps this one valid.
    'start: "x" | "a" loop\nloop: "b" loop',
    # Special tokens need the model's tokenizer: judged when the engine compiles it.
    "start: <|im_end|>",
])
def test_first_step_check_keeps_grammars_that_can_start(grammar):
    validate(G(grammar=grammar))


def test_matcher_accepts_several_tokens_rolls_back_and_terminates(backend, tokenizer):
    manager = GuidedDecodingManager(lambda: backend, len(tokenizer), 4, 8, 10.0)
    state = manager.grammar_for(G(regex=r"\d{3}-[a-c]{2}"))
    state.future.result()
    assert state.is_ready()
    tokens = _encode(tokenizer, "123-ab")
    assert state.accept_tokens(tokens[:-1]) == len(tokens) - 1
    assert not state.is_terminated()
    state.rollback(2)
    assert state.accept_tokens(tokens[-3:]) == 3
    assert state.is_terminated() and state.error is None
    bad = manager.grammar_for(G(regex=r"\d+"))
    bad.future.result()
    bad.is_ready()
    assert bad.accept_tokens(_encode(tokenizer, "x")) == 0


def test_cache_compiles_once_and_drops_failures():
    cache = CompiledGrammarCache(capacity=2)
    made = []

    def submit(value=None, exc=None):
        fut: Future = Future()
        made.append(fut)
        fut.set_exception(exc) if exc else fut.set_result(value)
        return lambda: fut

    assert cache.get("a", submit(1)).result() == 1
    assert cache.get("a", submit(2)).result() == 1  # hit: nothing submitted
    assert (cache.num_compiles, cache.hits) == (1, 1)
    cache.get("b", submit(3))
    cache.get("c", submit(4))  # evicts "a" (least recently used)
    assert cache.get("a", submit(5)).result() == 5 and cache.num_compiles == 4
    assert cache.get("bad", submit(exc=ValueError("x"))).exception() is not None
    assert cache.get("bad", submit(6)).result() == 6  # a failure is not cached
    assert len(cache) == 2


def test_batched_bitmask_matches_each_matcher_and_masks_logits(backend, tokenizer):
    vocab = len(tokenizer)
    manager = GuidedDecodingManager(lambda: backend, vocab, 4, 8, 10.0)
    states = [manager.grammar_for(G(choice=["yes", "no"])),
              manager.grammar_for(G(regex=r"[0-9]+"))]
    for s in states:
        s.future.result()
        assert s.is_ready()
    step = manager.start_bitmask([("a", states[0], []), ("b", states[1], [])])
    bitmask = step.result().copy()
    for row, s in enumerate(states):
        single = np.frombuffer(s.matcher.compute_bitmask(), dtype=np.int32)
        assert np.array_equal(bitmask[row], single[:bitmask.shape[1]])
    allowed = unpack_bitmask(bitmask, vocab)
    digits = {t for t in range(vocab) if re.fullmatch(r"[0-9]+", tokenizer.decode([t]))}
    assert digits and {int(t) for t in np.flatnonzero(allowed[1])} == digits
    logits = torch.randn(3, vocab)
    original = logits.clone()
    apply_token_bitmask(logits, torch.tensor([0, 2]), bitmask, resolve_kernels("auto", "cpu"))
    assert torch.equal(logits[1], original[1])  # an unconstrained row is untouched
    assert torch.isinf(logits[0][~torch.from_numpy(allowed[0])]).all()
    assert torch.equal(logits[2][torch.from_numpy(allowed[1])],
                       original[2][torch.from_numpy(allowed[1])])
    assert "yes".startswith(tokenizer.decode([int(logits[0].argmax())])) or \
        "no".startswith(tokenizer.decode([int(logits[0].argmax())]))


def test_compile_failure_and_timeout_become_errors(backend, tokenizer):
    manager = GuidedDecodingManager(lambda: backend, len(tokenizer), 4, 8, 10.0)
    state = manager.grammar_for(G(grammar="start: undefined"))
    assert state.future.exception() is not None
    assert not state.is_ready() and "undefined" in state.error
    now = [0.0]
    never: Future = Future()
    from bladellm.guided.manager import GrammarState

    slow = GrammarState(never, timeout=1.0, clock=lambda: now[0])
    assert not slow.is_ready() and slow.error is None
    now[0] = 2.0
    assert not slow.is_ready() and "--guided_compile_timeout" in slow.error


def test_grammar_size_limit_is_a_clear_error():
    from bladellm.guided.backend import GrammarLimits

    many = G(grammar="start: " + " | ".join(f'"item{i}" "!"' for i in range(1000)))
    validate(many)
    with pytest.raises(GrammarError, match="guided_grammar.*too big"):
        validate(many, GrammarLimits(max_grammar_size=1000))
    # Choices are one lexeme, bounded by the lexer's budget rather than the symbol count.
    with pytest.raises(GrammarError, match="guided_choice.*too big"):
        validate(G(choice=[f"item{i}" for i in range(3000)]),
                 GrammarLimits(initial_lexer_fuel=10_000))


def _reference_rows(matcher, width, tokens):
    """Masks after 0, 1, ... of ``tokens`` (while the grammar takes them), one at a time."""
    rows, n = [], 0
    for tok in [None] + list(tokens):
        if tok is not None:
            if matcher.try_consume_tokens([tok]) != 1:
                break
            n += 1
        rows.append(np.frombuffer(matcher.compute_bitmask(), dtype=np.int32)[:width].copy())
    matcher.rollback(n)
    return rows


def test_speculative_bitmask_has_a_row_per_verified_position(backend, tokenizer):
    """A request verifying k proposals gets k + 1 rows (row j: the grammar after j of them),
    its id repeated in req_ids; the matcher is back where it was afterwards; rows past a
    rejected token allow everything (never used, but never all-banned)."""
    vocab = len(tokenizer)
    manager = GuidedDecodingManager(lambda: backend, vocab, 2, 8, 10.0)  # 2 rows: it grows
    spec = manager.grammar_for(G(regex=r"\d{3}-[a-c]{2}"))
    plain = manager.grammar_for(G(regex=r"[0-9]+"))
    bad = manager.grammar_for(G(regex=r"\d{3}-[a-c]{2}"))
    for s in (spec, plain, bad):
        s.future.result()
        assert s.is_ready()
    good_draft = _encode(tokenizer, "123-a")
    bad_draft = _encode(tokenizer, "12x4")
    assert bad.accept_tokens(bad_draft) == 2
    bad.rollback(2)
    step = manager.start_bitmask([("s", spec, good_draft), ("p", plain, []),
                                  ("b", bad, bad_draft)])
    assert step.req_ids == ["s"] * 6 + ["p"] + ["b"] * 5
    bitmask = step.result().copy()
    width = bitmask.shape[1]
    expected = (_reference_rows(spec.matcher, width, good_draft)
                + _reference_rows(plain.matcher, width, [])
                + _reference_rows(bad.matcher, width, bad_draft))
    assert len(expected) == 6 + 1 + 3
    for row, want in zip(range(7), expected):
        assert np.array_equal(bitmask[row], want), row
    for row, want in zip(range(7, 10), expected[7:]):
        assert np.array_equal(bitmask[row], want), row
    assert (bitmask[10:12] == -1).all()  # after the rejected "x"
    # Matchers unchanged: the whole draft is still valid from the start.
    assert spec.accept_tokens(_encode(tokenizer, "123-ab")) == len(_encode(tokenizer, "123-ab"))
    assert spec.is_terminated()
    assert bad.accept_tokens(bad_draft) == 2


def test_bitmask_rows_follow_each_requests_verified_positions():
    from bladellm.sample.metadata import SamplingMetadata
    from bladellm.worker.sampling_rows import attach_grammar_bitmask_rows

    class Ready:
        req_ids = ["a", "a", "a", "b", "c"]

        def result(self):
            return np.arange(5, dtype=np.int32)[:, None].repeat(2, 1)

    md = SamplingMetadata(temperature=None, all_greedy=True, all_random=False, top_p=None,
                          top_k=None, min_p=None)
    # a verifies two proposals at rows 4, 5, 6; b samples once at row 0; c is not sampled.
    attach_grammar_bitmask_rows(md, Ready(), {"a": [4, 5, 6], "b": 0})
    assert md.grammar_rows.tolist() == [4, 5, 6, 0]
    assert md.grammar_bitmask[:, 0].tolist() == [0, 1, 2, 3]
