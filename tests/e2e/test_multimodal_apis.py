"""Images through ``/v1/responses`` (``input_image`` parts) and ``/v1/messages`` (Anthropic
``image`` blocks), driven by the official ``openai`` and ``anthropic`` clients against the tiny
LLaVA server of ``test_multimodal_server.py``: the same image and text give the chat path's
greedy answer and prompt length (the chat path is checked against transformers there), a
``previous_response_id`` follow-up reproduces the prompt with the earlier turn's image, and every
bad image or part is a 400 naming it, in each API's own error shape."""

from __future__ import annotations

import base64
import signal
import subprocess

import anthropic
import openai
import pytest
from PIL import Image

import test_multimodal_server as mm
from test_multimodal_server import data_url, hf_chat_greedy, image, part
from test_server import ServerProcess

# The LLaVA server's fixtures (module-scoped: this module starts its own server with them).
llava_dir, server, client, image_host = mm.llava_dir, mm.server, mm.client, mm.image_host

TOKENS = 6
GREEDY = {"temperature": 0.0}
IMAGE_TOKENS = 16  # tiny_vlm: 32 px / 8 px patches, "default" feature selection


@pytest.fixture
def aclient(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)


def chat_answer(client: openai.OpenAI, content: list[dict]) -> tuple[str, int]:
    resp = client.chat.completions.create(model="tiny-vlm", max_tokens=TOKENS, temperature=0.0,
                                          messages=[{"role": "user", "content": content}])
    return resp.choices[0].message.content, resp.usage.prompt_tokens


def input_image(url: str, detail: str = "auto") -> dict:
    return {"type": "input_image", "image_url": url, "detail": detail}


def b64_block(url: str, media_type: str | None = None) -> dict:
    mime, data = url[len("data:"):].split(";base64,", 1)
    return {"type": "image", "source": {"type": "base64", "media_type": media_type or mime,
                                        "data": data}}


# ------------------------------------------------------------------------------ /v1/responses


def test_responses_image_matches_transformers_and_chat(client, llava_dir):
    a, b = image(21, (40, 40)), image(22, (30, 50))
    resp = client.responses.create(
        model="tiny-vlm", max_output_tokens=TOKENS, temperature=0.0,
        input=[{"role": "user", "content": [
            input_image(data_url(a)), {"type": "input_text", "text": "The quick brown"},
            input_image(data_url(b), "low")]}])
    n, text = hf_chat_greedy(llava_dir, "<image>\nThe quick brown\n<image>", [a, b])
    assert resp.usage.input_tokens == n
    assert resp.output_text == text[:len(resp.output_text)] and resp.output_text
    chat_text, chat_n = chat_answer(client, [part(data_url(a)), {"type": "text",
                                            "text": "The quick brown"}, part(data_url(b))])
    assert (resp.output_text, resp.usage.input_tokens) == (chat_text, chat_n)


def test_follow_up_turn_keeps_the_earlier_image(client):
    url = data_url(image(23, (36, 36)))
    first_input = [{"role": "user", "content": [input_image(url),
                                                {"type": "input_text", "text": "Describe"}]}]
    first = client.responses.create(model="tiny-vlm", max_output_tokens=4, temperature=0.0,
                                    input=first_input)
    follow = client.responses.create(model="tiny-vlm", max_output_tokens=TOKENS,
                                     temperature=0.0, previous_response_id=first.id,
                                     input="And again")
    # The same conversation sent whole, without the store: the same prompt and answer.
    whole = client.responses.create(
        model="tiny-vlm", max_output_tokens=TOKENS, temperature=0.0, store=False,
        input=first_input + [{"role": "assistant", "content": first.output_text},
                             {"role": "user", "content": "And again"}])
    assert follow.usage.input_tokens == whole.usage.input_tokens
    assert follow.usage.input_tokens > first.usage.input_tokens + IMAGE_TOKENS // 2
    assert follow.output_text == whole.output_text
    stored = client.responses.input_items.list(follow.id, order="asc")
    kinds = [p.type for item in stored.data if item.type == "message" for p in item.content]
    assert "input_image" in kinds


def test_follow_up_counts_earlier_images_against_the_limit(client):
    url = data_url(image(24, (20, 20)))
    first = client.responses.create(
        model="tiny-vlm", max_output_tokens=2,
        input=[{"role": "user", "content": [input_image(url), input_image(url)]}])
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(
            model="tiny-vlm", max_output_tokens=2, previous_response_id=first.id,
            input=[{"role": "user", "content": [{"type": "input_text", "text": "and"},
                                                input_image(url)]}])
    assert err.value.body["param"] == "input[0].content[1]"
    assert "--limit_mm_per_prompt" in err.value.body["message"]


RESPONSES_BAD = {
    "file_id": ({"type": "input_image", "file_id": "file-abc", "detail": "auto"},
                "input[0].content[1].file_id", "file"),
    "no url": ({"type": "input_image", "detail": "auto"}, "input[0].content[1].image_url",
               "image_url"),
    "bad detail": (input_image(data_url(image(25, (20, 20))), "ultra"),
                   "input[0].content[1].detail", "detail"),
    "broken base64": (input_image("data:image/png;base64,@@@"), "input[0].content[1]",
                      "base64"),
    "MIME differs": (input_image(data_url(image(26, (20, 20)), mime="image/jpeg")),
                     "input[0].content[1]", "image/jpeg"),
    "too many pixels": (input_image(data_url(Image.new("RGB", (200, 200), (9, 99, 199)))),
                        "input[0].content[1]", "--max_image_pixels"),
    "http not allowed": (input_image("http://example.com/cat.png"), "input[0].content[1]",
                         "--allowed_media_domains"),
}


@pytest.mark.parametrize("case", sorted(RESPONSES_BAD))
def test_responses_bad_image_is_400_naming_the_part(client, case):
    bad, param, words = RESPONSES_BAD[case]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny-vlm", max_output_tokens=2, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "look"}, bad]}])
    assert err.value.body["param"] == param, err.value.body
    assert words in err.value.body["message"], err.value.body


def test_responses_image_in_an_assistant_message_is_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny-vlm", max_output_tokens=2, input=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [input_image(data_url(image(28, (20, 20))))]}])
    assert err.value.body["param"] == "input[1].content[0]"


def test_responses_fetches_from_an_allowed_host(client, image_host):
    resp = client.responses.create(model="tiny-vlm", max_output_tokens=2, input=[
        {"role": "user", "content": [input_image(image_host + "/ok.png")]}])
    assert resp.status in ("completed", "incomplete") and resp.usage.input_tokens > IMAGE_TOKENS
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny-vlm", max_output_tokens=2, input=[
            {"role": "user", "content": [input_image(image_host + "/text")]}])
    assert err.value.body["param"] == "input[0].content[0]"


def test_responses_stream_with_an_image_equals_the_whole_answer(client):
    body = dict(model="tiny-vlm", max_output_tokens=TOKENS, temperature=0.0, store=False,
                input=[{"role": "user", "content": [input_image(data_url(image(29, (30, 30)))),
                                                    {"type": "input_text", "text": "Paris"}]}])
    whole = client.responses.create(**body)
    events = list(client.responses.create(**body, stream=True))
    done = events[-1].response  # response.completed, or .incomplete at max_output_tokens
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert done.output_text == whole.output_text


# ------------------------------------------------------------------------------ /v1/messages


def test_messages_image_matches_chat_and_count_tokens(client, aclient):
    url = data_url(image(31, (40, 40)))
    jpeg = data_url(image(32, (30, 30)), "JPEG", quality=90)
    content = [b64_block(url), {"type": "text", "text": "The quick brown"}, b64_block(jpeg)]
    msg = aclient.messages.create(model="tiny-vlm", max_tokens=TOKENS, extra_body=GREEDY,
                                  messages=[{"role": "user", "content": content}])
    chat_text, chat_n = chat_answer(client, [part(url), {"type": "text",
                                            "text": "The quick brown"}, part(jpeg)])
    assert "".join(b.text for b in msg.content if b.type == "text") == chat_text
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat_n
    count = aclient.messages.count_tokens(model="tiny-vlm",
                                          messages=[{"role": "user", "content": content}])
    assert count.input_tokens == chat_n
    text_only = aclient.messages.count_tokens(
        model="tiny-vlm", messages=[{"role": "user", "content": "The quick brown"}])
    assert count.input_tokens >= text_only.input_tokens + 2 * IMAGE_TOKENS


def test_messages_url_source_from_an_allowed_host(aclient, image_host):
    msg = aclient.messages.create(model="tiny-vlm", max_tokens=2, messages=[
        {"role": "user", "content": [{"type": "image", "source": {
            "type": "url", "url": image_host + "/ok.png"}}, {"type": "text", "text": "hi"}]}])
    assert msg.stop_reason in ("end_turn", "max_tokens")


MESSAGES_BAD = {
    "media_type differs from the bytes": (b64_block(data_url(image(33, (20, 20))), "image/jpeg"),
                                          "messages[0].content[1]: ", "image/jpeg"),
    "unsupported media_type": (b64_block(data_url(image(34, (20, 20))), "image/bmp"),
                               "messages[0].content[1].source.media_type", "image/bmp"),
    "not an image": ({"type": "image", "source": {
        "type": "base64", "media_type": "image/png",
        "data": base64.b64encode(b"hello world").decode()}}, "messages[0].content[1]: ",
        "cannot decode"),
    "too many bytes": ({"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                    "data": "A" * 200_000}},
                       "messages[0].content[1]: ", "--max_image_bytes"),
    "url not allowed": ({"type": "image", "source": {"type": "url",
                                                     "url": "http://example.com/a.png"}},
                        "messages[0].content[1]: ", "--allowed_media_domains"),
    "file source": ({"type": "image", "source": {"type": "file", "file_id": "file_1"}},
                    "messages[0].content[1].source", "file"),
}


@pytest.mark.parametrize("case", sorted(MESSAGES_BAD))
@pytest.mark.parametrize("endpoint", ["create", "count_tokens"])
def test_messages_bad_image_is_an_anthropic_400(aclient, case, endpoint):
    block, where, words = MESSAGES_BAD[case]
    call = aclient.messages.create if endpoint == "create" else aclient.messages.count_tokens
    extra = {"max_tokens": 2} if endpoint == "create" else {}
    with pytest.raises(anthropic.BadRequestError) as err:
        call(model="tiny-vlm", **extra, messages=[
            {"role": "user", "content": [{"type": "text", "text": "look"}, block]}])
    body = err.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert body["error"]["message"].startswith(where), body
    assert words in body["error"]["message"], body


def test_messages_too_many_images_and_image_in_tool_result(aclient):
    block = b64_block(data_url(image(35, (20, 20))))
    with pytest.raises(anthropic.BadRequestError) as err:
        aclient.messages.create(model="tiny-vlm", max_tokens=2, messages=[
            {"role": "user", "content": [block, block, block]}])
    assert err.value.body["error"]["message"].startswith("messages[0].content[2]: ")
    assert "--limit_mm_per_prompt" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as err:
        aclient.messages.create(model="tiny-vlm", max_tokens=2, messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "cam",
                                               "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [block]}]}])
    assert err.value.body["error"]["message"].startswith("messages[2].content[0].content[0]")


def test_messages_stream_with_an_image(aclient):
    body = dict(model="tiny-vlm", max_tokens=TOKENS, extra_body=GREEDY, messages=[
        {"role": "user", "content": [b64_block(data_url(image(36, (30, 30)))),
                                     {"type": "text", "text": "Paris"}]}])
    whole = aclient.messages.create(**body)
    with aclient.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert [b.text for b in final.content] == [b.text for b in whole.content]


# ------------------------------------------------------------------- a text-only model: 400


@pytest.fixture(scope="module")
def text_server(tiny_model_factory):
    srv = ServerProcess([
        "--model", tiny_model_factory("llama"), "--served_model_name", "tiny", "--host",
        "127.0.0.1", "--port", "0", "--dtype", "float32", "--max_model_len", "256",
        "--num_kv_blocks", "128", "--num_threads", "1", "--disable_access_log"])
    srv.wait_ready(timeout=240)
    yield srv
    srv.proc.send_signal(signal.SIGTERM)
    try:
        srv.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        srv.proc.kill()


def test_text_only_model_refuses_images_naming_the_part(text_server):
    url = data_url(image(37, (20, 20)))
    oclient = openai.OpenAI(base_url=text_server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        oclient.responses.create(model="tiny", max_output_tokens=2, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "a"}, input_image(url)]}])
    assert err.value.body["param"] == "input[0].content[1]"
    assert "text-only" in err.value.body["message"]
    aclient = anthropic.Anthropic(base_url=text_server.url, api_key="x", max_retries=0)
    for call, extra in ((aclient.messages.create, {"max_tokens": 2}),
                        (aclient.messages.count_tokens, {})):
        with pytest.raises(anthropic.BadRequestError) as err:
            call(model="tiny", **extra, messages=[
                {"role": "user", "content": [{"type": "text", "text": "a"}, b64_block(url)]}])
        message = err.value.body["error"]["message"]
        assert message.startswith("messages[0].content[1]: ") and "text-only" in message
