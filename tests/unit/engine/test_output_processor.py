import pytest
from tiny_models import train_tokenizer

from bladellm.engine.messages import EngineCoreOutput, Logprobs
from bladellm.engine.output_processor import OutputProcessor
from bladellm.errors import ErrorKind
from bladellm.outputs import TokenLogprob
from bladellm.sampling_params import SamplingParams

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()


@pytest.fixture
def proc(tok):
    return OutputProcessor(tok)


def add(proc, tok, request_id="r", n=1, delta=True, arrival=100.0, **params):
    child_ids = [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]
    proc.add_request(request_id, PROMPT, tok.encode(PROMPT), SamplingParams(n=n, **params),
                     child_ids, arrival_time=arrival, delta=delta)
    return child_ids


def out(request_id, ids, **kw):
    return EngineCoreOutput(request_id=request_id, new_token_ids=list(ids), **kw)


def test_delta_stream_text_metrics_and_finish(proc, tok):
    text = "Paris is the capital of France. 你好 🚀"
    ids = tok.encode(text)
    add(proc, tok, max_tokens=len(ids))
    times = [100.5 + 0.25 * i for i in range(len(ids))]
    streamed, token_ids, ttfts, itls, finished = "", [], [], [], []
    for i, (tid, now) in enumerate(zip(ids, times)):
        last = i == len(ids) - 1
        res = proc.process_outputs(
            [out("r", [tid], finish_reason="length" if last else None,
                 queued_time=0.1 if i == 0 else 0.0, num_cached_tokens=3 if i == 0 else 0)],
            now)
        (completion,) = res.request_outputs["r"].outputs
        streamed += completion.text
        token_ids += completion.token_ids
        ttfts += res.iteration.time_to_first_tokens
        itls += res.iteration.inter_token_latencies
        finished += res.finished
        assert res.request_outputs["r"].finished == last
    assert streamed == text
    assert token_ids == ids
    assert ttfts == [pytest.approx(0.5)]
    assert itls == [pytest.approx(0.25)] * (len(ids) - 1)
    final = res.request_outputs["r"]
    assert final.outputs[0].finish_reason == "length"
    assert final.prompt == PROMPT and final.num_cached_tokens == 3
    assert final.metrics.first_token_time == 100.5
    assert final.metrics.first_scheduled_time == pytest.approx(100.1)
    assert final.metrics.finished_time == times[-1]
    (stats,) = finished
    assert stats.finish_reason == "length"
    assert stats.e2e_latency == pytest.approx(times[-1] - 100.0)
    assert stats.queued_time == pytest.approx(0.1)
    assert stats.num_prompt_tokens == len(tok.encode(PROMPT))
    assert stats.num_generation_tokens == len(ids)
    assert not proc.has_unfinished()


def test_cumulative_mode_returns_everything_so_far(proc, tok):
    ids = tok.encode("hello world! how are you")
    add(proc, tok, delta=False)
    for i in range(len(ids)):
        res = proc.process_outputs([out("r", [ids[i]])], 101.0 + i)
        (completion,) = res.request_outputs["r"].outputs
        assert completion.token_ids == ids[:i + 1]
        assert completion.text == tok.decode(ids[:i + 1])


def test_n_children_fan_in(proc, tok):
    children = add(proc, tok, request_id="p", n=2, delta=True)
    assert [proc.get_parent(c) for c in children] == ["p", "p"]
    a, b = tok.encode("hello"), tok.encode("world")
    res = proc.process_outputs([out("p-0", a[:1])], 101.0)
    assert [c.index for c in res.request_outputs["p"].outputs] == [0]  # only news
    res = proc.process_outputs([out("p-0", a[1:], finish_reason="stop", stop_reason=None),
                                out("p-1", b)], 102.0)
    ro = res.request_outputs["p"]
    assert [c.index for c in ro.outputs] == [0, 1] and not ro.finished
    assert res.iteration.inter_token_latencies == [pytest.approx(1.0)]  # one per parent
    assert res.iteration.num_generation_tokens == len(a) - 1 + len(b)
    res = proc.process_outputs([out("p-1", [2], finish_reason="stop", stop_reason=None)], 103.0)
    ro = res.request_outputs["p"]
    assert ro.finished and [c.index for c in ro.outputs] == [1]
    assert ro.outputs[0].text == "" and ro.outputs[0].token_ids == [2]  # EOS not decoded
    assert res.finished[0].num_generation_tokens == len(a) + len(b) + 1
    assert not proc.has_unfinished() and proc.get_parent("p-0") is None


def test_n_children_cumulative(proc, tok):
    add(proc, tok, request_id="p", n=2, delta=False)
    res = proc.process_outputs([out("p-1", tok.encode("fox"))], 101.0)
    ro = res.request_outputs["p"]
    assert [(c.index, c.text) for c in ro.outputs] == [(0, ""), (1, "fox")]


def test_stop_string_across_tokens_aborts_child_and_is_not_emitted(proc, tok):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text)
    add(proc, tok, stop=["fox jumps"])
    streamed, aborted, last = "", [], None
    for i, tid in enumerate(ids):
        res = proc.process_outputs([out("r", [tid])], 101.0 + i)
        if "r" not in res.request_outputs:
            break  # late outputs after the stop are ignored
        last = res.request_outputs["r"]
        streamed += last.outputs[0].text
        aborted += res.reqs_to_abort
        assert "The quick brown ".startswith(streamed)  # never a partial stop string
    assert streamed == "The quick brown "
    assert aborted == ["r"]
    assert last.finished
    assert last.outputs[0].finish_reason == "stop"
    assert last.outputs[0].stop_reason == "fox jumps"
    assert not proc.has_unfinished()


def test_stop_string_mid_batch_truncates_tokens_and_logprobs(proc, tok):
    ids = tok.encode("hello world! how are you")
    add(proc, tok, stop=["world"], include_stop_str_in_output=True, logprobs=0, delta=False)
    lp = Logprobs(token_ids=[[t] for t in ids], logprobs=[[-1.0]] * len(ids),
                  ranks=[1] * len(ids))
    res = proc.process_outputs([out("r", ids, new_logprobs=lp)], 101.0)
    (completion,) = res.request_outputs["r"].outputs
    assert completion.text == "hello world"
    assert tok.decode(completion.token_ids) == "hello world"
    assert len(completion.logprobs) == len(completion.token_ids)
    assert res.reqs_to_abort == ["r"]


def test_stop_string_on_the_core_final_token_is_not_aborted_again(proc, tok):
    ids = tok.encode("hello world")
    add(proc, tok, stop=["world"])
    res = proc.process_outputs([out("r", ids, finish_reason="length")], 101.0)
    assert res.reqs_to_abort == []
    assert res.request_outputs["r"].outputs[0].finish_reason == "stop"


def test_stop_token_excluded_from_text_unless_requested(proc, tok):
    ids = tok.encode("hi") + [tok.eos_token_id]
    add(proc, tok, request_id="a", skip_special_tokens=False)
    add(proc, tok, request_id="b", skip_special_tokens=False, include_stop_str_in_output=True)
    res = proc.process_outputs([out("a", ids, finish_reason="stop", stop_reason=7),
                                out("b", ids, finish_reason="stop")], 101.0)
    a, b = res.request_outputs["a"].outputs[0], res.request_outputs["b"].outputs[0]
    assert (a.text, a.token_ids, a.stop_reason) == ("hi", ids, 7)
    assert b.text == "hi<|im_end|>"


def test_logprobs_are_converted_with_decoded_tokens(proc, tok):
    add(proc, tok, logprobs=2)
    hello, world = tok.encode("hello")[0], tok.encode(" world")[0]
    lp = Logprobs(token_ids=[[hello, world, hello]], logprobs=[[-0.5, -0.1, -0.5]], ranks=[2])
    res = proc.process_outputs([out("r", [hello], new_logprobs=lp)], 101.0)
    assert res.request_outputs["r"].outputs[0].logprobs == [[
        TokenLogprob(hello, -0.5, 2, tok.decode([hello]), tok.decode([hello]).encode()),
        TokenLogprob(world, -0.1, 1, tok.decode([world]), tok.decode([world]).encode()),
        TokenLogprob(hello, -0.5, 2, tok.decode([hello]), tok.decode([hello]).encode()),
    ]]
    assert tok.decode([world]).startswith(" ")
    lp2 = Logprobs(token_ids=[[world, hello, world]], logprobs=[[-0.1, -0.5, -0.1]], ranks=[1])
    res = proc.process_outputs([out("r", [world], new_logprobs=lp2)], 102.0)
    (entry,) = res.request_outputs["r"].outputs[0].logprobs  # delta: only the new token
    assert entry[0].token_id == world and entry[0].rank == 1


def test_no_logprobs_unless_requested(proc, tok):
    add(proc, tok)
    lp = Logprobs(token_ids=[[5]], logprobs=[[-0.5]], ranks=[1])
    res = proc.process_outputs([out("r", [5], new_logprobs=lp)], 101.0)
    assert res.request_outputs["r"].outputs[0].logprobs is None


def test_error_output_fails_the_request_and_aborts_siblings(proc, tok):
    add(proc, tok, request_id="p", n=3, delta=True)
    proc.process_outputs([out("p-0", [5]), out("p-1", [6])], 101.0)
    proc.process_outputs([out("p-2", [7], finish_reason="length")], 101.5)
    res = proc.process_outputs([out("p-1", [], error="CUDA error: boom",
                                    error_kind=ErrorKind.FAILED)], 102.0)
    ro = res.request_outputs["p"]
    assert ro.finished and ro.error == "CUDA error: boom"
    assert ro.error_kind is ErrorKind.FAILED
    reasons = {c.index: c.finish_reason for c in ro.outputs}
    assert reasons == {0: "abort", 1: "error"}  # delta: child 2 finished earlier
    assert res.reqs_to_abort == ["p-0"]
    assert res.finished[0].finish_reason == "error"
    assert not proc.has_unfinished()
    assert proc.process_outputs([out("p-0", [8])], 103.0).request_outputs == {}


def test_error_kind_travels_to_the_request_output(proc, tok):
    """The front end picks the HTTP status from the kind (a grammar the client sent: 400)."""
    add(proc, tok, request_id="g")
    res = proc.process_outputs([out("g", [], error="guided_grammar: no output can satisfy",
                                    error_kind=ErrorKind.INVALID_GRAMMAR)], 101.0)
    ro = res.request_outputs["g"]
    assert ro.error_kind is ErrorKind.INVALID_GRAMMAR
    assert ro.error == "guided_grammar: no output can satisfy"


def test_abort_request(proc, tok):
    add(proc, tok, request_id="p", n=2)
    proc.process_outputs([out("p-0", [5], finish_reason="length")], 101.0)
    assert proc.abort_request("p") == ["p-1"]
    assert proc.abort_request("p") == []
    assert not proc.has_unfinished()
    res = proc.process_outputs([out("p-1", [6])], 104.0)  # late output: ignored
    assert res.request_outputs == {}
    (stats,) = res.finished
    assert stats.e2e_latency == pytest.approx(4.0) and stats.num_generation_tokens == 1
    assert stats.finish_reason == "abort"


def test_duplicate_request_id_is_rejected(proc, tok):
    add(proc, tok, request_id="r")
    with pytest.raises(ValueError, match="already in use"):
        add(proc, tok, request_id="r")


def test_malformed_output_fails_only_its_request(proc, tok):
    add(proc, tok, request_id="bad", logprobs=1)
    add(proc, tok, request_id="good")
    broken = Logprobs(token_ids=[[]], logprobs=[[]], ranks=[1])
    res = proc.process_outputs([out("bad", [5], new_logprobs=broken), out("good", [5])], 101.0)
    bad = res.request_outputs["bad"]
    assert bad.finished and bad.error and bad.outputs[0].finish_reason == "error"
    assert res.reqs_to_abort == ["bad"]  # still running in the core
    assert not res.request_outputs["good"].finished
    assert proc.num_unfinished() == 1


def test_logprobs_carry_raw_token_bytes_for_split_characters(proc, tok):
    text = "hi 😀🎉 你好"
    ids = tok.encode(text)
    add(proc, tok, logprobs=1, max_tokens=len(ids))
    lp = Logprobs(token_ids=[[t, t] for t in ids], logprobs=[[-0.1, -0.1]] * len(ids),
                  ranks=[1] * len(ids))
    res = proc.process_outputs([out("r", ids, new_logprobs=lp)], 101.0)
    entries = res.request_outputs["r"].outputs[0].logprobs
    assert any(e[0].decoded == "\ufffd" for e in entries)  # some tokens are partial characters
    assert b"".join(e[0].token_bytes for e in entries) == text.encode("utf-8")
    assert all(e[1].token_bytes == e[0].token_bytes for e in entries)
