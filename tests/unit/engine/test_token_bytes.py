"""Raw token bytes (chat logprobs ``bytes``) for byte-level BPE, SentencePiece-style and other
tokenizers: concatenating the bytes of a text's tokens gives the text's UTF-8."""

import pytest
from tiny_models import train_tokenizer
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from bladellm.engine.token_bytes import (
    BYTE_LEVEL,
    SENTENCEPIECE,
    TEXT,
    TokenBytes,
    bytes_to_unicode,
    token_bytes_for,
)

TEXTS = ["😀🎉🔥", "hello 你好, world 🚀!", "é ü — ß", "a\nb  c"]


@pytest.fixture(scope="module")
def byte_level():
    return train_tokenizer()


def sentencepiece_like():
    """A Llama-2-style vocabulary: ``▁`` for space, ``<0xNN>`` byte-fallback tokens, a few
    merges, and a multi-byte character (你) that is a piece of its own."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "h", "e", "l", "o", "w", "r", "d", "a", "b", "c", ",", "!", "你",
                  "▁h", "▁he", "▁hel", "▁hell", "▁hello"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "h"), ("▁h", "e"), ("▁he", "l"), ("▁hel", "l"), ("▁hell", "o")]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def ids_of(tok, text):
    return tok(text, add_special_tokens=False).input_ids


def test_bytes_to_unicode_is_gpt2s_alphabet():
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256))
    assert set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[ord("a")] == "a"


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_bpe_bytes_rebuild_the_text(byte_level, text):
    table = TokenBytes(byte_level)
    assert table.scheme == BYTE_LEVEL
    ids = ids_of(byte_level, text)
    if any(ord(ch) > 127 for ch in text):  # characters split into tokens that decode to U+FFFD
        assert any(byte_level.decode([i]) == "\ufffd" for i in ids)
    assert b"".join(table(i) for i in ids) == text.encode("utf-8")
    for i in ids:  # whole-character tokens: the same as their decoded text
        if "\ufffd" not in byte_level.decode([i]):
            assert table(i) == byte_level.decode([i]).encode("utf-8")


def test_byte_level_special_tokens_give_their_content(byte_level):
    table = TokenBytes(byte_level)
    for name in ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]:
        assert table(byte_level.convert_tokens_to_ids(name)) == name.encode()


def test_added_token_outside_the_byte_alphabet_gives_its_content():
    tok = train_tokenizer()
    tok.add_tokens(["<think>", "思考"])
    table = TokenBytes(tok)
    for name in ["<think>", "思考"]:
        assert table(tok.convert_tokens_to_ids(name)) == name.encode("utf-8")


@pytest.mark.parametrize("text", ["hello 你好 😀!", "🎉🔥", "hello, world"])
def test_sentencepiece_byte_fallback_bytes_rebuild_the_text(text):
    tok = sentencepiece_like()
    table = TokenBytes(tok)
    assert table.scheme == SENTENCEPIECE
    ids = ids_of(tok, text)
    if "😀" in text or "🎉" in text:
        assert any(tok.convert_ids_to_tokens(i).startswith("<0x") for i in ids)
    # The normalizer prepends "▁" (a space) to the text, as SentencePiece does.
    assert b"".join(table(i) for i in ids) == (" " + text).encode("utf-8")
    assert table(tok.convert_tokens_to_ids("<0xF0>")) == b"\xf0"
    assert table(tok.convert_tokens_to_ids("▁hello")) == b" hello"
    assert table(tok.convert_tokens_to_ids("</s>")) == b"</s>"


def test_metaspace_decoder_is_sentencepiece():
    tok = sentencepiece_like()
    tok.backend_tokenizer.decoder = decoders.Metaspace()
    assert TokenBytes(tok).scheme == SENTENCEPIECE


class Plain:
    """Neither a fast tokenizer nor a known slow one: bytes are the decoded text's UTF-8."""

    def __init__(self, inner):
        self.inner = inner

    def __len__(self):
        return len(self.inner)

    def decode(self, ids, skip_special_tokens=False):
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_unknown_tokenizer_falls_back_to_decoded_text(byte_level):
    tok = Plain(byte_level)
    table = TokenBytes(tok)
    assert table.scheme == TEXT
    for i in ids_of(byte_level, "hi 你"):
        assert table(i) == byte_level.decode([i]).encode("utf-8")
    assert table(10**9, decoded="x") == b"x"  # outside the vocabulary: not cached


def test_one_table_per_tokenizer(byte_level):
    assert token_bytes_for(byte_level) is token_bytes_for(byte_level)
    assert token_bytes_for(train_tokenizer()) is not token_bytes_for(byte_level)
