import random

import pytest
from tiny_models import train_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from bladellm.engine.detokenizer import (
    FastIncrementalDetokenizer,
    IncrementalDetokenizer,
    SlowIncrementalDetokenizer,
)
from bladellm.sampling_params import SamplingParams

# Characters the tiny byte-level vocab has no merges for: each is split into 2-4 byte tokens.
ALPHABET = list("abcdefghij klmnop.,\n") + ["é", "ü", "你", "好", "🚀", "—", "ß"]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()


class SlowOnly:
    """A tokenizer without a Rust backend, to exercise the re-decoding fallback."""

    def __init__(self, tok):
        self._tok = tok

    def decode(self, ids, skip_special_tokens=False):
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def make(tok, impl, prompt_ids=(), **params):
    tokenizer = SlowOnly(tok) if impl == "slow" else tok
    return IncrementalDetokenizer.from_tokenizer(tokenizer, SamplingParams(**params), prompt_ids)


def stream(detok, ids, rng=None, stop_terminated=False):
    """Feed ids in random-sized chunks; return the concatenated deltas and each step's total."""
    rng = rng or random.Random(0)
    emitted, totals, i = "", [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        chunk = ids[i:i + n]
        i += n
        last = i >= len(ids)
        stop = detok.update(chunk, stop_terminated=stop_terminated and last)
        emitted += detok.get_delta_text(finished=last or stop is not None)
        totals.append(emitted)
        if stop is not None:
            break
    return emitted, totals


def test_factory_picks_decode_stream_for_fast_tokenizers(tok):
    assert isinstance(make(tok, "fast"), FastIncrementalDetokenizer)
    assert isinstance(make(tok, "slow"), SlowIncrementalDetokenizer)


@pytest.mark.parametrize("impl", ["fast", "slow"])
def test_streamed_text_equals_full_decode_of_random_text(tok, impl):
    rng = random.Random(1)
    split_chars = 0
    for _ in range(60):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40)))
        ids = tok.encode(text, add_special_tokens=False)
        split_chars += sum("\ufffd" in tok.decode([i]) for i in ids)
        prompt = tok.encode(rng.choice(["Paris is", "你好", "x"]), add_special_tokens=False)
        detok = make(tok, impl, prompt_ids=prompt)
        emitted, _ = stream(detok, ids, rng)
        assert emitted == tok.decode(ids) == text
        assert detok.output_text == text
        assert detok.token_ids == ids
    assert split_chars > 50  # multi-byte characters really were split across tokens


@pytest.mark.parametrize("impl", ["fast", "slow"])
@pytest.mark.parametrize("skip_special", [True, False])
def test_streamed_text_equals_full_decode_of_random_ids(tok, impl, skip_special):
    rng = random.Random(2)
    for _ in range(60):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 30))]
        detok = make(tok, impl, skip_special_tokens=skip_special)
        emitted, _ = stream(detok, ids, rng)
        full = tok.decode(ids, skip_special_tokens=skip_special)
        # Bytes of an unfinished character at the very end stay pending instead of U+FFFD.
        assert emitted == full.rstrip("\ufffd")


def test_prompt_context_keeps_the_leading_space_of_a_continuation():
    # SentencePiece-style: "▁world" decodes to "world" alone but " world" after "hello".
    vocab = {"▁hello": 0, "▁world": 1, "[UNK]": 2}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    detok = IncrementalDetokenizer.from_tokenizer(backend, SamplingParams(), [0])
    detok.update([1, 1])
    assert detok.output_text == " world world"
    assert backend.decode([1, 1]) == "world world"


@pytest.mark.parametrize("impl", ["fast", "slow"])
def test_stop_string_split_across_tokens_is_matched_and_never_emitted(tok, impl):
    text = "Paris is the capital of France. Berlin is the capital of Germany."
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    stop = "capital of Fr"
    assert not any(stop in p for p in pieces)  # it spans several tokens
    for seed in range(5):
        detok = make(tok, impl, stop=[stop])
        emitted, totals = stream(detok, ids, random.Random(seed))
        assert emitted == "Paris is the "
        assert all("Paris is the ".startswith(t) for t in totals)  # no partial "cap"
        assert detok.stop_string == stop
        # Tokens after the one completing the stop string are not consumed.
        assert tok.decode(detok.token_ids) == "Paris is the capital of Fr"


@pytest.mark.parametrize("impl", ["fast", "slow"])
def test_include_stop_str_in_output(tok, impl):
    ids = tok.encode("Paris is the capital of France.", add_special_tokens=False)
    detok = make(tok, impl, stop=["capital"], include_stop_str_in_output=True)
    emitted, _ = stream(detok, ids)
    assert emitted == "Paris is the capital"


def test_earliest_stop_string_wins_and_text_after_it_is_dropped(tok):
    ids = tok.encode("hello world! how are you today?", add_special_tokens=False)
    detok = make(tok, "fast", stop=["today", "how", "zzz"])
    assert detok.update(ids) == "how"  # one call with all tokens: both matches are in the text
    assert detok.get_text() == "hello world! "
    assert detok.update(tok.encode(" more", add_special_tokens=False)) is None
    assert detok.output_text == "hello world! "


def test_held_back_text_is_released_when_no_stop_string_follows(tok):
    ids = tok.encode("the lazy dog", add_special_tokens=False)
    detok = make(tok, "fast", stop=["dogma"])
    detok.update(ids)
    assert detok.get_delta_text(finished=False) == "the lazy dog"[:-4]
    assert detok.get_text(finished=False) == "the lazy dog"[:-4]
    assert detok.get_delta_text(finished=True) == " dog"
    assert detok.get_text(finished=True) == "the lazy dog"


def test_stop_token_is_counted_but_not_decoded(tok):
    ids = tok.encode("hello world", add_special_tokens=False) + [tok.eos_token_id]
    detok = make(tok, "fast", skip_special_tokens=False)
    detok.update(ids, stop_terminated=True)
    assert detok.output_text == "hello world"
    assert detok.token_ids == ids
    detok = make(tok, "fast", skip_special_tokens=False, include_stop_str_in_output=True)
    detok.update(ids, stop_terminated=True)
    assert detok.output_text == "hello world<|im_end|>"


def test_stop_strings_ignored_within_min_tokens(tok):
    ids = tok.encode("hello hello world", add_special_tokens=False)
    num_first = len(tok.encode("hello", add_special_tokens=False))
    detok = make(tok, "fast", stop=["hello"], min_tokens=num_first, max_tokens=20)
    assert detok.update(ids) == "hello"
    assert detok.output_text == "hello "
