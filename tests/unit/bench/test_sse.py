"""SSE parsing and request payloads."""

import pytest

from bladellm.bench.client import RequestOptions, SSEParser, build_payload, chunk_text
from bladellm.bench.datasets import BenchRequest

STREAM = (b'data: {"a": 1}\n\n'
          b': keep-alive comment\n\n'
          b'event: message\r\ndata: {"b": 2}\r\n\r\n'
          b'data: line1\ndata: line2\n\n'
          b'data:nospace\n\n'
          b'data: [DONE]\n\n')
EXPECTED = ['{"a": 1}', '{"b": 2}', "line1\nline2", "nospace", "[DONE]"]


def _parse(pieces):
    p = SSEParser()
    out = []
    for piece in pieces:
        out.extend(p.feed(piece))
    out.extend(p.close())
    return out


def test_whole_stream():
    assert _parse([STREAM]) == EXPECTED


@pytest.mark.parametrize("size", [1, 2, 3, 7, 13])
def test_events_split_across_reads(size):
    assert _parse([STREAM[i:i + size] for i in range(0, len(STREAM), size)]) == EXPECTED


def test_last_event_without_blank_line_is_flushed():
    assert _parse([b'data: {"x": 1}\n', b"data: tail"]) == ['{"x": 1}\ntail']


def test_utf8_split_inside_a_character():
    data = 'data: {"t": "héllo"}\n\n'.encode()
    cut = data.index("é".encode()) + 1
    assert _parse([data[:cut], data[cut:]]) == ['{"t": "héllo"}']


def test_chunk_text_completions_and_chat():
    assert chunk_text({"choices": [{"text": "ab"}]}) == "ab"
    assert chunk_text({"choices": [{"delta": {"content": "c"}}]}) == "c"
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}) == ""
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""


def test_payloads():
    req = BenchRequest("hi", 1, 7, system="sys")
    opts = RequestOptions(model="m", endpoint="chat", ignore_eos=True, eos_logit_bias=(2, 5))
    p = build_payload(req, opts)
    assert p["messages"] == [{"role": "system", "content": "sys"},
                             {"role": "user", "content": "hi"}]
    assert p["max_tokens"] == 7 and p["stream"] is True
    assert p["stream_options"] == {"include_usage": True}
    assert p["ignore_eos"] is True and p["logit_bias"] == {"2": -100, "5": -100}
    p = build_payload(req, RequestOptions(model="m", include_usage=False))
    assert p["prompt"] == "sys\nhi"
    assert "stream_options" not in p and "ignore_eos" not in p and "logit_bias" not in p
