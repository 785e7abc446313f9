"""--reasoning_parser: the thinking/answer split, whole and streamed (any delta boundaries)."""

import random

import pytest

from bladellm.entrypoints.cli.args import parse_args
from bladellm.entrypoints.openai.config import ServerConfig
from bladellm.entrypoints.openai.reasoning import get_reasoning_parser
from bladellm.entrypoints.openai.serving_common import ServingContext

QWEN3 = get_reasoning_parser("qwen3")
R1 = get_reasoning_parser("deepseek_r1")

# (text, qwen3 split, deepseek_r1 split)
CASES = [
    ("<think>\nLet me think.\n</think>\n\nThe answer is 4.",
     ("Let me think.", "The answer is 4."), ("Let me think.", "The answer is 4.")),
    ("Let me think.\n</think>\n\nThe answer.",  # the template opened <think> (R1)
     (None, "Let me think.\n</think>\n\nThe answer."), ("Let me think.", "The answer.")),
    ("Just an answer.", (None, "Just an answer."), ("Just an answer.", "")),
    ("<think>\ntruncated thinking", ("truncated thinking", ""), ("truncated thinking", "")),
    ("<think>\n\n</think>\n\nHi", (None, "Hi"), (None, "Hi")),
    ("  <think>a</think>b", ("a", "b"), ("a", "b")),
    ("<think>x < y and a</thin b</think>{\"k\": 1}",
     ("x < y and a</thin b", "{\"k\": 1}"), ("x < y and a</thin b", "{\"k\": 1}")),
    ("<think>a\n\nb\n</think>c</think>d", ("a\n\nb", "c</think>d"), ("a\n\nb", "c</think>d")),
    ("<thinking is fun", (None, "<thinking is fun"), ("<thinking is fun", "")),
    ("", (None, ""), (None, "")),
    ("<think>a</thi", ("a</thi", ""), ("a</thi", "")),
    ("<thi", (None, "<thi"), ("<thi", "")),
    ("\n\nHello", (None, "\n\nHello"), ("Hello", "")),
]


@pytest.mark.parametrize("text,qwen3,r1", CASES)
def test_split(text, qwen3, r1):
    assert QWEN3.split(text) == qwen3
    assert R1.split(text) == r1


def _stream(parser, pieces):
    s = parser.streamer()
    reasoning, answer = [], []
    for piece in pieces:
        r, a = s.feed(piece)
        reasoning.append(r)
        answer.append(a)
    r, a = s.finish()
    reasoning.append(r)
    answer.append(a)
    return "".join(reasoning), "".join(answer), reasoning, answer


@pytest.mark.parametrize("parser", [QWEN3, R1], ids=lambda p: p.name)
@pytest.mark.parametrize("text", [c[0] for c in CASES])
def test_stream_matches_split_at_every_boundary(parser, text):
    expected_r, expected_a = parser.split(text)
    for cut in range(len(text) + 1):
        for cut2 in (cut, min(len(text), cut + 3)):
            r, a, _, _ = _stream(parser, [text[:cut], text[cut:cut2], text[cut2:]])
            assert (r or None, a) == (expected_r, expected_a), (cut, cut2)
    rng = random.Random(0)
    for _ in range(30):
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(1, 4)
            pieces.append(text[i:i + n])
            i += n
        r, a, _, _ = _stream(parser, pieces)
        assert (r or None, a) == (expected_r, expected_a), pieces


def test_partial_tag_is_held_back_not_leaked():
    s = QWEN3.streamer()
    assert s.feed("<thi") == ("", "")
    assert s.feed("nk>\nstep one</th") == ("step one", "")
    assert s.feed("ink>\n\nOK") == ("", "OK")
    assert s.finish() == ("", "")
    s = R1.streamer()
    assert s.feed("a</") == ("a", "")
    assert s.feed("x") == ("</x", "")
    assert s.feed("\n") == ("", "")  # may be the layout newline before </think>
    assert s.feed("more") == ("\nmore", "")
    assert s.finish() == ("", "")


def test_no_tags_streams_answer_immediately_for_qwen3():
    s = QWEN3.streamer()
    assert s.feed("Hel") == ("", "Hel")
    assert s.feed("lo <think>") == ("", "lo <think>")
    assert s.finish() == ("", "")


def test_lookup_and_errors():
    assert get_reasoning_parser(None) is None
    assert get_reasoning_parser("qwen3").name == "qwen3"
    with pytest.raises(ValueError, match="--reasoning_parser"):
        get_reasoning_parser("granite")


def test_flag_config_and_serving_context():
    _, server = parse_args(["--reasoning_parser", "deepseek_r1"])
    assert server.reasoning_parser == "deepseek_r1"
    _, server = parse_args(["--reasoning-parser", "qwen3"])
    assert server.reasoning_parser == "qwen3"
    assert ServerConfig().reasoning_parser is None
    with pytest.raises(ValueError, match="--reasoning_parser"):
        ServerConfig(reasoning_parser="granite")
    with pytest.raises(SystemExit):
        parse_args(["--reasoning_parser", "granite"])

    class Info:
        served_model_name, max_model_len, vocab_size, tokenizer = "m", 64, 10, None
        sampling_defaults: dict = {}

    class Engine:
        model_info = Info()

    ctx = ServingContext.from_engine(Engine(), ServerConfig(reasoning_parser="qwen3"))
    assert ctx.reasoning_parser is get_reasoning_parser("qwen3")
    assert ServingContext.from_engine(Engine(), ServerConfig()).reasoning_parser is None


def test_the_prompt_decides_who_opened_the_thinking():
    closed = QWEN3.for_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert closed.split("<think>x</think>y") == (None, "<think>x</think>y")
    assert R1.for_prompt("...</think>\n").split("a</think>b") == (None, "a</think>b")
    opened = QWEN3.for_prompt("<|im_start|>assistant\n<think>\n")
    assert opened.split("hmm\n</think>\n\nok") == ("hmm", "ok")
    assert opened.split("unfinished") == ("unfinished", "")
    assert QWEN3.for_prompt("<|im_start|>assistant\n") is QWEN3
    assert R1.for_prompt("<｜Assistant｜><think>\n").split("a</think>b") == ("a", "b")
    s = closed.streamer()
    assert s.feed("<thi") == ("", "<thi") and not s.in_reasoning
