"""Stop strings, stop token ids, ``ignore_eos`` and ``min_tokens`` under speculation (issue 9,
item 1): when several tokens are accepted in one step, a request still ends exactly where
``--decode_algo normal`` ends it, with the same tokens, text, finish_reason and stop_reason.

High-acceptance setup: the tiny Llama with its attention output projections zeroed, so that the
next token depends on the last token only (a fixed map, token -> token). Greedy decoding then
runs into a short cycle within a few tokens: look_ahead's n-gram pool learns the cycle and its
guesses are accepted whole, and sps with the model as its own draft accepts everything; so steps
emit up to gram_size - 1 + 1 (look_ahead) or gamma + 1 (sps) tokens and most stops fall inside
such a step. The EOS variant swaps token 2 (EOS) with a token of that cycle, so that EOS comes
back every cycle: with ``ignore_eos`` it is emitted and generation goes on, inside accepted runs.
Every run asserts that proposed tokens were accepted (multi-token steps happened).

The scheduler's cost rule (core/spec_decode.py) would rightly find that a self-draft never pays
for itself; ``--spec_policy always`` switches it off here so that speculation runs on every step
(what is emitted never depends on it).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bladellm import LLM, SamplingParams
from test_offline_llm import _prompts  # noqa: E402  (tests/e2e is on sys.path via rootdir)

EOS = 2
MAX_TOKENS = 40
ENGINE = dict(dtype="float32", block_size=4, max_num_batched_tokens=64, max_num_seqs=8,
              num_kv_blocks=256, max_model_len=160, debug_block_accounting=True)
ALGOS = {
    "look_ahead": dict(decode_algo="look_ahead", look_ahead_window_size=4,
                       look_ahead_gram_size=5, guess_set_size=4, spec_policy="always"),
    "sps": dict(decode_algo="sps", gamma=4, spec_policy="always"),  # draft: the target itself
}


def _rewrite(src: str, dst: Path, swap_eos_with: int | None = None) -> str:
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    for name in weights:
        if name.endswith("self_attn.o_proj.weight"):
            weights[name] = torch.zeros_like(weights[name])
    if swap_eos_with is not None:  # relabel: EOS takes that token's place in the cycle
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            w = weights[name].clone()
            w[[EOS, swap_eos_with]] = w[[swap_eos_with, EOS]]
            weights[name] = w
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


class _Engines:
    """One LLM per (model, algorithm), kept for the module; acceptance counted per call."""

    def __init__(self) -> None:
        self._llms: dict[tuple[str, str], LLM] = {}

    def get(self, model: str, algo: str) -> LLM:
        key = (model, algo)
        if key not in self._llms:
            extra = dict(ALGOS.get(algo, {}))
            if algo == "sps":
                extra["draft_model"] = model
            self._llms[key] = LLM(model=model, **ENGINE, **extra)
        return self._llms[key]

    def run(self, model: str, algo: str, prompts, params: SamplingParams):
        llm = self.get(model, algo)
        sched = llm.engine.core.scheduler
        before = sched.get_stats()
        outs = llm.generate(prompts, params, use_tqdm=False)
        after = sched.get_stats()
        assert sched.kv_cache_manager.pool.num_used_blocks == 0  # pool back to empty
        drafted = after.num_spec_draft_tokens - before.num_spec_draft_tokens
        accepted = after.num_spec_accepted_tokens - before.num_spec_accepted_tokens
        return [o.outputs[0] for o in outs], drafted, accepted


@pytest.fixture(scope="module")
def engines():
    yield _Engines()


@pytest.fixture(scope="module")
def prompts():
    return _prompts(384)


@pytest.fixture(scope="module")
def first_order(tiny_llama, tmp_path_factory):
    return _rewrite(tiny_llama, tmp_path_factory.mktemp("first-order") / "m")


@pytest.fixture(scope="module")
def first_order_eos(first_order, tmp_path_factory, engines, prompts):
    outs, _, _ = engines.run(first_order, "normal", prompts[:1],
                             SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    tokens = outs[0].token_ids
    assert len(set(tokens[-12:])) < 12, "the first-order model should cycle"
    in_cycle = tokens[-1]
    assert in_cycle != EOS
    return _rewrite(str(Path(first_order)), tmp_path_factory.mktemp("first-order-eos") / "m",
                    swap_eos_with=in_cycle)


def _check_same(engines, model, algo, prompts, params):
    """Run normal and ``algo``; outputs must be identical; return normal's outputs."""
    expected, _, _ = engines.run(model, "normal", prompts, params)
    got, drafted, accepted = engines.run(model, algo, prompts, params)
    for i, (e, g) in enumerate(zip(expected, got)):
        assert g.token_ids == e.token_ids, f"prompt {i}"
        assert g.text == e.text, f"prompt {i}"
        assert (g.finish_reason, g.stop_reason) == (e.finish_reason, e.stop_reason), f"prompt {i}"
    # Several tokens were really accepted in one step.
    assert accepted > 0, (drafted, accepted)
    if algo == "sps" and not params.min_tokens:
        # The target as its own draft accepts everything. (Not under min_tokens: the draft
        # proposes from the raw model, EOS / stop ids included, which the target masks.)
        assert accepted == drafted
    return expected


def _stop_strings(text: str) -> list[str]:
    """Two or three characters from the middle of a cycle's text (no U+FFFD from a partial
    UTF-8 token, no whitespace only)."""
    out = []
    for start in range(len(text) // 3, len(text) - 3):
        for n in (2, 3):
            s = text[start:start + n]
            if "\ufffd" not in s and s.strip() and s not in out:
                out.append(s)
                break
        if len(out) == 3:
            break
    return out


def test_high_acceptance_setup(engines, first_order, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for algo in ALGOS:
        _, drafted, accepted = engines.run(first_order, algo, prompts, params)
        # Most of the output came in multi-token steps.
        assert accepted >= len(prompts) * MAX_TOKENS // 3, (algo, drafted, accepted)


@pytest.mark.parametrize("algo", list(ALGOS))
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings(engines, first_order, prompts, algo, include):
    plain, _, _ = engines.run(first_order, "normal", prompts[:1],
                              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    stops = _stop_strings(plain[0].text)
    assert stops
    for stop in stops:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop],
                                include_stop_str_in_output=include)
        expected = _check_same(engines, first_order, algo, prompts, params)
        assert any(o.finish_reason == "stop" and o.stop_reason == stop for o in expected)
        for o in expected:
            if o.finish_reason == "stop":
                assert o.text.endswith(stop) if include else stop not in o.text


@pytest.mark.parametrize("algo", list(ALGOS))
def test_stop_token_ids(engines, first_order, prompts, algo):
    plain, _, _ = engines.run(first_order, "normal", prompts,
                              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    # Tokens first seen at several depths of the outputs, so the stops land at varied offsets
    # of a multi-token step.
    picks = sorted({o.token_ids[k] for o in plain[:4] for k in (3, 9, 14)} - {EOS})[:4]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=picks)
    expected = _check_same(engines, first_order, algo, prompts, params)
    stopped = [o for o in expected if o.finish_reason == "stop"]
    assert stopped and all(o.stop_reason in picks and o.token_ids[-1] in picks for o in stopped)
    assert any(len(o.token_ids) > 1 for o in stopped)


@pytest.mark.parametrize("algo", list(ALGOS))
def test_eos_stops_and_ignore_eos_continues(engines, first_order_eos, prompts, algo):
    stop_at_eos = _check_same(engines, first_order_eos, algo, prompts,
                              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert sum(o.finish_reason == "stop" for o in stop_at_eos) >= len(prompts) // 2
    assert all(o.token_ids[-1] == EOS for o in stop_at_eos if o.finish_reason == "stop")

    ignored = _check_same(engines, first_order_eos, algo, prompts,
                          SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                         ignore_eos=True))
    assert all(o.finish_reason == "length" and len(o.token_ids) == MAX_TOKENS for o in ignored)
    # EOS emitted (more than once) in the middle of the output, generation went on.
    assert any(o.token_ids[:-1].count(EOS) >= 2 for o in ignored)


@pytest.mark.parametrize("algo", list(ALGOS))
def test_min_tokens(engines, first_order, first_order_eos, prompts, algo):
    # EOS suppressed until min_tokens: the output goes past the EOS that normal decoding
    # would stop at, then may stop at a later one.
    plain, _, _ = engines.run(first_order_eos, "normal", prompts,
                              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    min_tokens = max(len(o.token_ids) for o in plain if o.finish_reason == "stop") + 2
    assert min_tokens < MAX_TOKENS
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=min_tokens)
    expected = _check_same(engines, first_order_eos, algo, prompts, params)
    assert all(len(o.token_ids) >= min_tokens for o in expected)
    assert all(EOS not in o.token_ids[:min_tokens] for o in expected)

    # Stop token ids suppressed too: a token met early does not end the request before then.
    plain, _, _ = engines.run(first_order, "normal", prompts[:1],
                              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    early = plain[0].token_ids[1]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[early],
                            min_tokens=6)
    expected = _check_same(engines, first_order, algo, prompts, params)
    assert all(len(o.token_ids) >= 6 and early not in o.token_ids[:6] for o in expected)
    assert any(o.finish_reason == "stop" and o.stop_reason == early for o in expected)
