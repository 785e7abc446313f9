"""Reasoning models end to end with a tiny random model.

Offline: a constrained request whose end-of-thinking ids are two tokens the model writes on its
own (greedy) keeps exactly its unconstrained thinking, then answers with JSON the schema
accepts: the grammar never touched the thinking and held from the end tag on.
Server (``--reasoning_parser qwen3``, a Qwen3-style template written here that opens or closes
``<think>`` at the generation prompt): chat_template_kwargs.enable_thinking reaches the
template, structured output applies to the answer, and reasoning_content of an earlier turn is
rendered, all through the official ``openai`` client.
"""

from __future__ import annotations

import json
import signal
import subprocess

import jsonschema
import openai
import pytest

from bladellm import LLM, SamplingParams
from bladellm.sampling_params import GuidedDecodingParams
from test_server import ServerProcess

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                   "maximum": 99}},
          "required": ["n"], "additionalProperties": False}

QWEN3_LIKE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and m.get('reasoning_content') %}"
    "<think>\n{{ m['reasoning_content'] }}\n</think>\n\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")


def test_grammar_starts_after_the_thinking_offline(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", max_model_len=512, num_kv_blocks=128,
              max_num_seqs=4, num_threads=1)
    _check_gated_generation(llm)


def test_speculative_decoding_across_the_end_of_the_thinking(tiny_llama):
    """A self-draft proposes the model's own tokens: drafts run through the thinking and across
    its end tag into the grammar's rows; greedy output is the same as without speculation."""
    llm = LLM(model=tiny_llama, dtype="float32", max_model_len=512, num_kv_blocks=128,
              max_num_seqs=4, num_threads=1, decode_algo="sps", draft_model=tiny_llama,
              gamma=3, spec_policy="always")
    _check_gated_generation(llm)
    assert llm.engine.core.scheduler.get_stats().num_spec_draft_tokens > 0


def _check_gated_generation(llm):
    prompt = "Think, then answer in JSON:"
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    # Two tokens the model writes by itself, first seen at position i >= 2, end its thinking.
    i = next(i for i in range(2, len(free) - 1)
             if all(free[j:j + 2] != free[i:i + 2] for j in range(i)))
    end = free[i:i + 2]
    guided = GuidedDecodingParams(json=SCHEMA, reasoning_end=end)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True,
                                                guided_decoding=guided),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:i + 2] == free[:i + 2]  # the thinking is the model's own
    answer = llm.get_tokenizer().decode(out.token_ids[i + 2:], skip_special_tokens=True)
    jsonschema.validate(json.loads(answer), SCHEMA)
    assert out.finish_reason == "stop"
    # Without the gate the grammar would have forced "{" at once.
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=200,
                                                  guided_decoding=GuidedDecodingParams(
                                                      json=SCHEMA)),
                         use_tqdm=False)[0].outputs[0]
    assert plain.text.startswith("{") and plain.token_ids[:i + 2] != free[:i + 2]


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    srv = ServerProcess([
        "--model", tiny_model_factory("llama"), "--served_model_name", "tiny",
        "--host", "127.0.0.1", "--port", "0", "--dtype", "float32", "--max_model_len", "512",
        "--num_kv_blocks", "256", "--disable_access_log", "--num_threads", "1",
        "--reasoning_parser", "qwen3", "--chat_template", QWEN3_LIKE_TEMPLATE])
    srv.wait_ready(timeout=240)
    yield srv
    srv.proc.send_signal(signal.SIGTERM)
    try:
        srv.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        srv.proc.kill()


@pytest.fixture
def client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                              timeout=120)


MSGS = [{"role": "user", "content": "Reply in JSON."}]


async def test_thinking_on_and_off_through_the_template(client):
    # The template opened <think>: a random model never closes it, so all is thinking.
    on = await client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=8,
                                              temperature=0, extra_body={"ignore_eos": True})
    msg = on.choices[0].message
    assert msg.content is None and msg.reasoning_content and msg.reasoning == \
        msg.reasoning_content
    msg_on = msg.reasoning_content
    assert on.usage.completion_tokens_details.reasoning_tokens == 8
    # enable_thinking false: the template closed it, so all is answer, constrained from the
    # first token.
    off = await client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=100, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    msg = off.choices[0].message
    assert getattr(msg, "reasoning_content", None) is None
    jsonschema.validate(json.loads(msg.content), SCHEMA)
    assert off.usage.completion_tokens_details.reasoning_tokens == 0
    # Thinking on and a schema: the grammar waits for </think> (its ids cross to the engine
    # core with the constraint), which a random model never writes: all thinking, unconstrained.
    gated = await client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=8, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
        extra_body={"ignore_eos": True})
    assert gated.choices[0].message.content is None
    assert gated.choices[0].message.reasoning_content == msg_on


async def test_earlier_thinking_is_rendered_for_the_next_turn(client):
    def turn(**thinking):
        return [*MSGS, {"role": "assistant", "content": "{}", **thinking},
                {"role": "user", "content": "Again."}]

    base = dict(model="tiny", max_tokens=1)
    without = await client.chat.completions.create(messages=turn(), **base)
    for name in ("reasoning_content", "reasoning"):
        with_it = await client.chat.completions.create(
            messages=turn(**{name: "I thought about it."}), **base)
        assert with_it.usage.prompt_tokens > without.usage.prompt_tokens + 4, name


async def test_streamed_thinking(client):
    stream = await client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=6, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    thinking = "".join([getattr(c.choices[0].delta, "reasoning_content", None) or ""
                        async for c in stream if c.choices])
    full = await client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=6,
                                                temperature=0, extra_body={"ignore_eos": True})
    assert thinking == full.choices[0].message.reasoning_content
