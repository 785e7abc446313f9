"""Multimodal pieces without a model: flags, block hashes with images, the encoder cache's
hold/release rules, and the input processor's refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from bladellm.config import MultiModalConfig, parse_mm_limits
from bladellm.core.hashing import extend_block_hashes
from bladellm.engine.input_processor import InputProcessor, MessageError
from bladellm.engine.model_info import load_model_info
from bladellm.multimodal.inputs import MultiModalItem, TensorData
from bladellm.sampling_params import SamplingParams
from bladellm.worker.encoder_cache import EncoderCache
from tiny_models import make_tiny_model
from tiny_vlm import make_tiny_llava


def item(hash_: str, offset: int, length: int) -> MultiModalItem:
    pixels = np.full((1, 2), float(offset), np.float32)
    return MultiModalItem(modality="image", hash=hash_, offset=offset, length=length,
                          tensors={"pixel_values": TensorData.of(pixels)})


# ---- flags --------------------------------------------------------------------------------------

def test_limit_flag_forms():
    assert parse_mm_limits("image=3") == {"image": 3}
    assert parse_mm_limits('{"image": 0}') == {"image": 0}
    assert MultiModalConfig().image_limit == 8
    for bad in ("video=2", "image=x", "image", '{"image": -1}', "{bad"):
        with pytest.raises(ValueError, match="--limit_mm_per_prompt"):
            MultiModalConfig(limit_mm_per_prompt=bad)


@pytest.mark.parametrize("kwargs,flag", [
    ({"max_image_pixels": 0}, "--max_image_pixels"),
    ({"max_image_bytes": "lots"}, "--max_image_bytes"),
    ({"media_fetch_timeout": 0.0}, "--media_fetch_timeout"),
    ({"allowed_media_domains": ["http://a.com/"]}, "--allowed_media_domains"),
])
def test_bad_flags_name_themselves(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        MultiModalConfig(**kwargs)


# ---- block hashes -------------------------------------------------------------------------------

def test_block_hashes_differ_exactly_from_the_image_on():
    tokens = list(range(20))  # 5 blocks of 4; the image covers positions 6..13
    a = extend_block_hashes([], tokens, 4, None, [item("aaa", 6, 8)])
    b = extend_block_hashes([], tokens, 4, None, [item("bbb", 6, 8)])
    same = extend_block_hashes([], tokens, 4, None, [item("aaa", 6, 8)])
    assert a == same
    assert a[0] == b[0]  # before the image
    assert all(x != y for x, y in zip(a[1:], b[1:]))  # the image's blocks and every later one
    assert extend_block_hashes([], tokens, 4)[0] == a[0]


# ---- encoder cache ------------------------------------------------------------------------------

class _Encoder:
    def __init__(self) -> None:
        self.calls = 0

    def encode_image(self, tensors):
        self.calls += 1
        value = float(tensors["pixel_values"].flatten()[0])
        return (100 * value + torch.arange(8.0))[:, None].expand(8, 3)  # row r: 100 * v + r

    def embed_input_ids(self, ids):
        return torch.zeros(len(ids), 3)


def test_encoder_cache_slices_chunks_and_frees_when_consumed():
    cache, model = EncoderCache(torch.device("cpu")), _Encoder()
    img = item("h1", 2, 8)
    cache.add_request("r1", [img])
    cache.add_request("r2", [img])  # the same image in flight twice: one entry
    # The image is at positions [2, 10). r1's chunk: positions [0, 6) (image rows 0..3);
    # r2's chunk: positions [4, 12) (image rows 2..7, then two text tokens).
    emb = cache.input_embeds(model, torch.zeros(14, dtype=torch.long), ["r1", "r2"],
                             np.array([0, 6, 14]), np.array([0, 4]))
    assert model.calls == 1
    rows = emb[:, 0].tolist()
    assert rows == [0, 0, 200, 201, 202, 203] + [202, 203, 204, 205, 206, 207, 0, 0]
    assert len(cache) == 1  # r1 still needs it
    emb = cache.input_embeds(model, torch.zeros(4, dtype=torch.long), ["r1"],
                             np.array([0, 4]), np.array([6]))
    assert emb[:, 0].tolist() == [204, 205, 206, 207]
    assert model.calls == 1 and len(cache) == 0  # sliced, not recomputed; then freed
    # A text-only chunk gets no embeddings of its own.
    cache.add_request("r3", [item("h3", 10, 8)])
    assert cache.input_embeds(model, torch.zeros(4, dtype=torch.long), ["r3"],
                              np.array([0, 4]), np.array([0])) is None
    cache.remove_requests(["r3"])  # finished / aborted / preempted before the image
    assert len(cache) == 0 and not cache._holders


# ---- input processing ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llava_processor(tmp_path_factory):
    d = make_tiny_llava(tmp_path_factory.mktemp("llava"))
    return InputProcessor(load_model_info(d), mm_config=MultiModalConfig(
        limit_mm_per_prompt="image=1"))


def test_placeholders_must_match_images(llava_processor):
    params = SamplingParams(max_tokens=2)
    img = Image.new("RGB", (30, 30))
    reqs = llava_processor.process("r", "<image> hi", params, 0.0, images=[img])
    (mm,) = reqs[0].mm_items
    assert mm.length == 16 and reqs[0].prompt_token_ids[mm.offset:mm.end] == \
        [llava_processor.images.spec.image_token_id] * 16
    with pytest.raises(ValueError, match="1 image placeholder"):
        llava_processor.process("r", "<image> hi", params, 0.0)
    with pytest.raises(ValueError, match="0 image placeholder"):
        llava_processor.process("r", "hi", params, 0.0, images=[img])
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        llava_processor.process("r", "<image><image>", params, 0.0, images=[img, img])


def test_text_only_model_refuses_images(tmp_path):
    processor = InputProcessor(load_model_info(make_tiny_model(tmp_path)))
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "hi"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    with pytest.raises(MessageError, match="text-only") as err:
        processor.load_chat_images(messages)
    assert err.value.param == "messages[0].content[1]"
    with pytest.raises(MessageError, match="text-only"):
        processor.apply_chat_template(messages)
    with pytest.raises(ValueError, match="text-only"):
        processor.process("r", "hi", SamplingParams(max_tokens=2), 0.0,
                          images=[Image.new("RGB", (8, 8))])
