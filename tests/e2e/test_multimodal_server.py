"""Images through ``blade_llm_server`` with the official ``openai`` client: data: URLs in
chat content parts give transformers' greedy tokens; every bad image is a 400 naming the part,
and the server keeps serving."""

from __future__ import annotations

import base64
import http.server
import io
import threading

import openai
import pytest
import torch
import transformers
from PIL import Image

from test_server import ServerProcess
from tiny_vlm import PATCH_SIZE, make_tiny_llava

MAX_TOKENS = 8


def image(seed: int, size: tuple[int, int]) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def data_url(img: Image.Image, fmt: str = "PNG", mime: str | None = None, **save) -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **save)
    mime = mime or f"image/{fmt.lower()}"
    return f"data:{mime};base64,{base64.b64encode(buf.getvalue()).decode()}"


def part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return make_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="module")
def server(llava_dir):
    srv = ServerProcess([
        "--model", llava_dir, "--served_model_name", "tiny-vlm", "--host", "127.0.0.1",
        "--port", "0", "--dtype", "float32", "--max_model_len", "256", "--num_kv_blocks", "256",
        "--block_size", "4", "--num_threads", "1", "--disable_access_log",
        "--limit-mm-per-prompt", '{"image": 2}', "--max_image_pixels", "10000",
        "--max_image_bytes", "64KiB", "--shutdown_timeout", "5",
        "--allowed_media_domains", "127.0.0.1", "--media_fetch_timeout", "5"])
    srv.wait_ready(timeout=240)
    yield srv
    srv.proc.terminate()
    srv.proc.wait(timeout=30)


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def hf_chat_greedy(model_dir: str, text: str, images: list[Image.Image]) -> tuple[int, str]:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32).eval()
    processor = transformers.LlavaProcessor(
        image_processor=transformers.AutoImageProcessor.from_pretrained(model_dir),
        tokenizer=tok, patch_size=PATCH_SIZE, num_additional_image_tokens=1,
        vision_feature_select_strategy="default", image_token="<image>")
    enc = processor(text=rendered, images=images, return_tensors="pt")
    with torch.no_grad():
        gen = model.generate(**enc, do_sample=False, max_new_tokens=MAX_TOKENS, pad_token_id=0)
    n = enc["input_ids"].shape[1]
    return n, tok.decode(gen[0, n:], skip_special_tokens=True)


def test_chat_with_images_matches_transformers(client, llava_dir):
    a, b = image(1, (40, 40)), image(2, (64, 30))
    resp = client.chat.completions.create(
        model="tiny-vlm", max_tokens=MAX_TOKENS, temperature=0.0,
        messages=[{"role": "user", "content": [
            part(data_url(a)), {"type": "text", "text": "The quick brown"},
            part(data_url(b, "JPEG", quality=95))]}])
    # The server decoded the JPEG itself: hand transformers the same decoded pixels.
    b_decoded = Image.open(io.BytesIO(base64.b64decode(
        data_url(b, "JPEG", quality=95).split(",", 1)[1]))).convert("RGB")
    n, text = hf_chat_greedy(llava_dir, "<image>\nThe quick brown\n<image>", [a, b_decoded])
    assert resp.usage.prompt_tokens == n
    assert resp.choices[0].message.content == text


@pytest.mark.parametrize("fmt", ["WEBP", "GIF"])
def test_webp_and_gif_first_frame(client, fmt):
    resp = client.chat.completions.create(
        model="tiny-vlm", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "hello"}, part(data_url(image(3, (30, 30)), fmt))]}])
    assert resp.choices[0].finish_reason in ("stop", "length")


def _truncated_png() -> str:
    url = data_url(image(4, (40, 40)))
    raw = base64.b64decode(url.split(",", 1)[1])
    return "data:image/png;base64," + base64.b64encode(raw[:len(raw) // 2]).decode()


def _bomb_png() -> str:
    # Compresses to a few KB but claims 5000x5000 pixels: refused from its header.
    return data_url(Image.new("L", (5000, 5000)))


BAD = {
    "broken base64": ("data:image/png;base64,@@@not-base64@@@", "base64"),
    "not an image": ("data:image/png;base64," + base64.b64encode(b"hello world").decode(),
                     "cannot decode"),
    "truncated": (_truncated_png(), "cannot decode"),
    "wrong MIME": ("data:text/plain;base64,aGVsbG8=", "MIME"),
    "MIME differs from data": (data_url(image(5, (20, 20)), "PNG", mime="image/jpeg"),
                               "image/jpeg"),
    "bmp": (data_url(image(6, (20, 20)), "BMP"), "MIME"),
    "too many pixels": (data_url(Image.new("RGB", (200, 200), (9, 99, 199))),
                        "--max_image_pixels"),
    "decompression bomb": (_bomb_png(), "--max_image_pixels"),
    "too many bytes": ("data:image/png;base64," + "A" * 200_000, "--max_image_bytes"),
    "http not allowed": ("http://example.com/cat.png", "--allowed_media_domains"),
    "file scheme": ("file:///etc/passwd", "scheme"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_image_is_400_naming_the_part(client, case):
    url, words = BAD[case]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny-vlm", max_tokens=2, messages=[
                {"role": "system", "content": "hi"},
                {"role": "user", "content": [{"type": "text", "text": "look"}, part(url)]}])
    body = err.value.body
    assert body["param"] == "messages[1].content[1]", body
    assert words in body["message"], body


def test_too_many_images_is_400(client):
    url = data_url(image(8, (20, 20)))
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-vlm", max_tokens=2, messages=[
            {"role": "user", "content": [part(url), part(url), part(url)]}])
    assert err.value.body["param"] == "messages[0].content[2]"
    assert "--limit_mm_per_prompt" in err.value.body["message"]


def test_still_serving_after_bad_images(client):
    resp = client.chat.completions.create(
        model="tiny-vlm", max_tokens=2, messages=[{"role": "user", "content": [
            part(data_url(image(9, (25, 25)))), {"type": "text", "text": "ok"}]}])
    assert resp.choices[0].finish_reason in ("stop", "length")


class _ImageHost(http.server.BaseHTTPRequestHandler):
    """Serves /ok.png, /big.png, /text (not an image) and /away (redirects off-host)."""

    png = base64.b64decode(data_url(image(10, (30, 30))).split(",", 1)[1])

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/away":
            self.send_response(302)
            self.send_header("Location", "http://example.com/x.png")
            self.end_headers()
            return
        body, mime = {"/ok.png": (self.png, "image/png"),
                      "/big.png": (b"\0" * 100_000, "image/png"),
                      "/text": (b"hello", "text/plain")}.get(self.path, (b"", "text/plain"))
        self.send_response(200 if body else 404)
        self.send_header("Content-Type", mime)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ImageHost)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_fetch_from_an_allowed_host(client, image_host):
    resp = client.chat.completions.create(model="tiny-vlm", max_tokens=2, messages=[
        {"role": "user", "content": [part(image_host + "/ok.png")]}])
    assert resp.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("path,words", [("/big.png", "--max_image_bytes"),
                                        ("/text", "Content-Type"),
                                        ("/away", "not in --allowed_media_domains"),
                                        ("/missing", "cannot fetch")])
def test_bad_fetch_is_400(client, image_host, path, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-vlm", max_tokens=2, messages=[
            {"role": "user", "content": [part(image_host + path)]}])
    assert err.value.body["param"] == "messages[0].content[0]"
    assert words in err.value.body["message"], err.value.body


def test_streamed_answer_equals_the_whole_one(client):
    messages = [{"role": "user", "content": [
        part(data_url(image(11, (40, 30)))), {"type": "text", "text": "Paris is"}]}]
    whole = client.chat.completions.create(model="tiny-vlm", max_tokens=6, temperature=0.0,
                                           messages=messages)
    stream = client.chat.completions.create(model="tiny-vlm", max_tokens=6, temperature=0.0,
                                            messages=messages, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content
