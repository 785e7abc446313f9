"""``--guided_compile_timeout`` measures a request's own compilation: time queued behind other
clients' expensive grammars, or building the tokenizer bridge, does not count; one expensive
grammar does not hold up every other compilation (two compile threads)."""

from __future__ import annotations

import time

from bladellm.guided.backend import GrammarError
from bladellm.guided.manager import GuidedDecodingManager
from bladellm.sampling_params import GuidedDecodingParams as G


class _SlowBackend:
    """Compiles ``choice`` constraints in ``len(choice[0]) * 0.1`` s (a sleep: no GIL held)."""

    def compile(self, params):
        time.sleep(len(params.choice[0]) * 0.1)
        if params.choice[0].startswith("bad"):
            raise GrammarError("guided_choice: bad")
        return _Proto()


class _Proto:
    def deep_copy(self):
        return self

    def is_error(self):
        return False


def _settle(states, limit=5.0):
    """Poll like the scheduler does each step until every state is ready or failed."""
    start = time.monotonic()
    while time.monotonic() - start < limit:
        if all(s.is_ready() or s.error is not None for s in states):
            return
        time.sleep(0.02)
    raise AssertionError("grammars neither compiled nor failed")


def _manager(backend_factory=_SlowBackend, timeout=0.5):
    return GuidedDecodingManager(backend_factory, 256, 4, 8, timeout)


def test_queued_compile_does_not_time_out_behind_expensive_grammars():
    manager = _manager()
    try:
        heavy = [manager.grammar_for(G(choice=[c * 6, "x"])) for c in "ab"]  # 0.6 s each
        trivial = [manager.grammar_for(G(choice=[c, "y"])) for c in "cdef"]  # 0.1 s each
        _settle(heavy + trivial)
        # The heavy grammars' own compile exceeded the timeout: the client's constraint.
        assert all("--guided_compile_timeout (0.5 s)" in (s.error or "") for s in heavy)
        # The trivial ones waited > 0.5 s in the queue but compiled in 0.1 s: valid.
        assert [s.error for s in trivial] == [None] * 4
        assert all(s.is_ready() for s in trivial)
    finally:
        manager.shutdown()


def test_tokenizer_bridge_build_does_not_count_against_the_timeout():
    def factory():
        time.sleep(0.7)  # the first-use tokenizer bridge
        return _SlowBackend()

    manager = _manager(factory)
    try:
        states = [manager.grammar_for(G(choice=["a", "b"])),
                  manager.grammar_for(G(choice=["c", "d"]))]
        _settle(states)
        assert [s.error for s in states] == [None, None]
    finally:
        manager.shutdown()


def test_cheap_grammar_compiles_while_an_expensive_one_runs():
    manager = _manager(timeout=10.0)
    try:
        heavy = manager.grammar_for(G(choice=["a" * 10, "x"]))  # 1 s
        time.sleep(0.05)
        cheap = manager.grammar_for(G(choice=["b", "y"]))  # 0.1 s
        _settle([cheap], limit=0.6)
        assert cheap.is_ready() and not heavy.is_ready()
        _settle([heavy])
    finally:
        manager.shutdown()


def test_failed_compile_is_still_its_own_error():
    manager = _manager(timeout=10.0)
    try:
        state = manager.grammar_for(G(choice=["bad", "x"]))
        _settle([state])
        assert state.error == "guided_choice: bad"
    finally:
        manager.shutdown()
