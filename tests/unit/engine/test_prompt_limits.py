"""A hopeless prompt is refused by its length in characters, before it is tokenized."""

import time

import pytest

from bladellm.engine.input_processor import InputProcessor
from bladellm.engine.model_info import load_model_info
from bladellm.engine.prompt_limits import SAFETY_FACTOR, max_token_chars
from bladellm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def info(tiny_llama):
    return load_model_info(tiny_llama)


def test_limit_is_a_true_lower_bound_on_tokens(info):
    longest = max_token_chars(info.tokenizer)
    ids = info.tokenizer.encode("The quick brown fox " * 50, add_special_tokens=False)
    decoded = [info.tokenizer.decode([i]) for i in ids]
    assert max(map(len, decoded)) <= longest


def test_huge_prompt_is_refused_without_tokenizing(info, monkeypatch):
    proc = InputProcessor(info)
    assert proc.max_prompt_chars == info.max_model_len * max_token_chars(info.tokenizer) \
        * SAFETY_FACTOR
    calls = []
    monkeypatch.setattr(info.tokenizer, "encode", lambda *a, **k: calls.append(1) or [5])
    start = time.monotonic()
    with pytest.raises(ValueError, match="cannot fit in the model's maximum context length"):
        proc.process("r", "x" * (10 << 20), SamplingParams(max_tokens=1), 0.0)
    assert time.monotonic() - start < 0.5 and not calls
    # At the limit the exact token count decides.
    proc.process("r", "x" * 10, SamplingParams(max_tokens=1), 0.0)
    assert calls
