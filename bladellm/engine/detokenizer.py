"""Incremental detokenization and stop-string matching for one output sequence.

Text semantics (both implementations):

- ``output_text`` is the continuation of the prompt: the stream is primed with a few prompt
  tokens, so a SentencePiece "▁word" keeps its leading space. For byte-level BPE it equals
  ``tokenizer.decode(output_ids)``, except that bytes of an incomplete UTF-8 character at the end
  stay pending (they would decode to U+FFFD) until the character is complete.
- A token that ends the request as a stop token (EOS or ``stop_token_ids``) is counted in
  ``token_ids`` but not decoded, unless ``include_stop_str_in_output``.
- Stop strings are matched on the accumulated text, so a stop string split across tokens is
  found. The earliest match wins; the text is cut before it (after it with
  ``include_stop_str_in_output``) and tokens after the matching one are not consumed.
  Stop strings are not checked until more than ``min_tokens`` tokens were generated.
- ``get_delta_text`` / ``get_text`` return only text that is safe to show: while unfinished they
  hold back the last ``max(len(stop)) - 1`` characters, which could be the start of a stop
  string. Once finished (or a stop string matched) they return everything.

``FastIncrementalDetokenizer`` uses ``tokenizers.decoders.DecodeStream`` on the fast tokenizer's
backend; ``SlowIncrementalDetokenizer`` re-decodes a small window of tokens with
``tokenizer.decode`` for tokenizers without a Rust backend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import tokenizers
from tokenizers.decoders import DecodeStream

from bladellm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens used as decoding context: at least this many, more if they end mid-character.
_MIN_CONTEXT_TOKENS = 4
_MAX_CONTEXT_TOKENS = 24
_INVALID_PREFIX_ERROR = "Invalid prefix encountered"


class IncrementalDetokenizer:
    """Base: stop strings and hold-back. Subclasses implement ``_decode_next``."""

    def __init__(self, params: SamplingParams) -> None:
        self.stop: list[str] = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.skip_special_tokens = params.skip_special_tokens
        self.stop_buffer_length = (
            max(len(s) for s in self.stop) - 1
            if self.stop and not self.include_stop_str_in_output else 0)
        self.token_ids: list[int] = []  # output tokens consumed so far
        self.stop_string: str | None = None  # the stop string that matched, once one did
        self._text = ""
        self._num_emitted_chars = 0

    @classmethod
    def from_tokenizer(cls, tokenizer, params: SamplingParams,
                       prompt_token_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
        """The fast implementation when the tokenizer has a ``tokenizers`` backend."""
        backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(
            tokenizer, "_tokenizer", None)
        if isinstance(backend, tokenizers.Tokenizer):
            return FastIncrementalDetokenizer(backend, params, prompt_token_ids)
        if isinstance(tokenizer, tokenizers.Tokenizer):
            return FastIncrementalDetokenizer(tokenizer, params, prompt_token_ids)
        return SlowIncrementalDetokenizer(tokenizer, params, prompt_token_ids)

    @property
    def output_text(self) -> str:
        """All text decoded so far (cut at a matched stop string), including held-back text."""
        return self._text

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Consume ``new_token_ids``; return the matched stop string, if one matched now.

        ``stop_terminated``: the last id is the stop token that ended the request in the core.
        After a match, the remaining ids of this call are not consumed and later calls are
        no-ops returning ``None``.
        """
        if self.stop_string is not None:
            return None
        last = len(new_token_ids) - 1
        for i, token_id in enumerate(new_token_ids):
            self.token_ids.append(token_id)
            if i == last and stop_terminated and not self.include_stop_str_in_output:
                break
            new_text = self._decode_next(token_id)
            if not new_text:
                continue
            old_len = len(self._text)
            self._text += new_text
            if self.stop and len(self.token_ids) > self.min_tokens:
                self.stop_string = self._match_stop(old_len)
                if self.stop_string is not None:
                    return self.stop_string
        return None

    def get_delta_text(self, finished: bool = False) -> str:
        """Safe text not returned by an earlier call; advances the emitted mark."""
        end = self._safe_end(finished)
        delta = self._text[self._num_emitted_chars:end]
        self._num_emitted_chars = max(self._num_emitted_chars, end)
        return delta

    def get_text(self, finished: bool = False) -> str:
        """All safe text so far (cumulative); does not move the emitted mark."""
        return self._text[:self._safe_end(finished)]

    def _safe_end(self, finished: bool) -> int:
        if finished or self.stop_string is not None:
            return len(self._text)
        return max(len(self._text) - self.stop_buffer_length, self._num_emitted_chars)

    def _match_stop(self, old_len: int) -> str | None:
        """Earliest stop string ending in the text added after ``old_len``; cuts the text."""
        best_index, best_stop = -1, None
        for stop in self.stop:
            index = self._text.find(stop, max(0, old_len - len(stop) + 1))
            if index != -1 and (best_stop is None or index < best_index):
                best_index, best_stop = index, stop
        if best_stop is None:
            return None
        end = best_index + len(best_stop) if self.include_stop_str_in_output else best_index
        self._text = self._text[:end]
        return best_stop

    def _decode_next(self, token_id: int) -> str:
        raise NotImplementedError


class FastIncrementalDetokenizer(IncrementalDetokenizer):
    def __init__(self, tokenizer: tokenizers.Tokenizer, params: SamplingParams,
                 prompt_token_ids: Sequence[int] = ()) -> None:
        super().__init__(params)
        self._tokenizer = tokenizer
        context = _prompt_context(
            lambda ids: tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens),
            prompt_token_ids)
        self._stream = self._new_stream(context)

    def _new_stream(self, context: list[int]) -> DecodeStream:
        try:
            return DecodeStream(ids=context, skip_special_tokens=self.skip_special_tokens)
        except TypeError:  # tokenizers < 0.22 cannot prefill; step through the context instead
            stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            for token_id in context:
                stream.step(self._tokenizer, token_id)
            return stream

    def _decode_next(self, token_id: int) -> str:
        try:
            return self._stream.step(self._tokenizer, token_id) or ""
        except (OverflowError, TypeError):
            logger.warning("cannot decode token id %r; skipping it", token_id)
            return ""
        except Exception as e:
            if _INVALID_PREFIX_ERROR not in str(e):
                raise
            # Some decoders produce text that is not a prefix of the longer decode (non-monotone
            # cleanup); the stream cannot continue, so restart it at this token.
            logger.warning("decode stream reset after %r", e)
            self._stream = self._new_stream([])
            return self._stream.step(self._tokenizer, token_id) or ""


class SlowIncrementalDetokenizer(IncrementalDetokenizer):
    """Decodes ``ids[prefix_offset:]`` and emits what it adds to ``ids[prefix_offset:read_offset]``.

    Same algorithm as DecodeStream: nothing is emitted while the window ends in an incomplete
    character; after each emission the window restarts at the previous read offset.
    """

    def __init__(self, tokenizer, params: SamplingParams,
                 prompt_token_ids: Sequence[int] = ()) -> None:
        super().__init__(params)
        self._tokenizer = tokenizer
        self._ids = _prompt_context(self._decode, prompt_token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def _decode_next(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""
        # Drop ids that can no longer be part of a window.
        del self._ids[:self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        return full_text[len(prefix_text):]


def _prompt_context(decode: Callable[[list[int]], str], prompt_token_ids: Sequence[int]
                    ) -> list[int]:
    """The shortest prompt suffix (4..24 tokens) that decodes to whole characters, or []."""
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        return []
    for n in range(min(_MIN_CONTEXT_TOKENS, num_prompt), min(_MAX_CONTEXT_TOKENS, num_prompt) + 1):
        suffix = list(prompt_token_ids[-n:])
        if _REPLACEMENT_CHAR not in decode(suffix):
            return suffix
    return []
