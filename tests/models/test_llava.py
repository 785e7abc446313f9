"""LLaVA through the engine vs transformers, float32, greedy: token-identical outputs with one
image, images of different sizes, image-text-image, chunked prefill cutting through an image,
preemption with images in flight, and the prompt cache keyed by image content."""

from __future__ import annotations

import pytest
import torch
import transformers
from PIL import Image

from bladellm import LLM, SamplingParams
from tiny_vlm import PATCH_SIZE, make_tiny_llava

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return make_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))


def image(seed: int, size: tuple[int, int]) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def hf_greedy(model_dir: str, cases: list[tuple[str, list[Image.Image]]]):
    """(expanded prompt ids, greedy output ids) per case, from transformers' own processor
    and generate."""
    model = transformers.LlavaForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32).eval()
    cfg = model.config
    processor = transformers.LlavaProcessor(
        image_processor=transformers.AutoImageProcessor.from_pretrained(model_dir),
        tokenizer=transformers.AutoTokenizer.from_pretrained(model_dir),
        patch_size=PATCH_SIZE, num_additional_image_tokens=1,
        vision_feature_select_strategy=cfg.vision_feature_select_strategy,
        image_token="<image>")
    results = []
    with torch.no_grad():
        for text, images in cases:
            enc = processor(text=text, images=images, return_tensors="pt")
            gen = model.generate(**enc, do_sample=False, max_new_tokens=MAX_TOKENS,
                                 pad_token_id=0)
            n = enc["input_ids"].shape[1]
            results.append((enc["input_ids"][0].tolist(), gen[0, n:].tolist()))
    return results


CASES = [
    ("<image>\nThe quick brown fox", [image(1, (40, 40))]),
    # Two images of different sizes (the processor resizes and crops both).
    ("<image><image> Paris is the capital of", [image(2, (64, 48)), image(3, (20, 90))]),
    # Image, text, image.
    ("<image> Once upon a time there was a small engine <image> that served",
     [image(4, (50, 50)), image(5, (33, 71))]),
]


def run(llm: LLM, cases, **params):
    prompts = [{"prompt": text, "multi_modal_data": {"image": imgs}} for text, imgs in cases]
    return llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                **params), use_tqdm=False)


def check_same(outs, expected):
    for i, (out, (ids, tokens)) in enumerate(zip(outs, expected)):
        assert out.prompt_token_ids == ids, f"case {i}: expanded prompt differs"
        assert out.outputs[0].token_ids == tokens, f"case {i}"


def test_greedy_identical_to_transformers(llava_dir):
    llm = LLM(model=llava_dir, dtype="float32", block_size=4, num_kv_blocks=128, max_model_len=256,
              debug_block_accounting=True)
    check_same(run(llm, CASES), hf_greedy(llava_dir, CASES))
    runner = llm.engine.core.executor.worker.model_runner
    assert len(runner.encoder_cache) == 0  # every entry freed with its requests
    # vision_feature_layer -2 of 2: the tower's last layer is not built (it would run for
    # nothing), and the tokens above are still transformers' own.
    assert len(runner.model.vision_tower.encoder.layers) == 1


def test_chunked_prefill_and_preemption_through_images(llava_dir):
    """Chunks of 6 tokens cut every 16-token image; a tiny KV pool preempts requests with
    images in flight. Each image still runs through the encoder once per admission."""
    cases = CASES * 2
    llm = LLM(model=llava_dir, dtype="float32", block_size=4, max_num_batched_tokens=6,
              max_num_seqs=6, num_kv_blocks=24, max_model_len=80,
              debug_block_accounting=True, disable_prompt_cache=True)
    check_same(run(llm, cases), hf_greedy(llava_dir, cases))
    stats = llm.engine.core.scheduler.get_stats()
    assert stats.num_preemptions > 0
    assert stats.num_used_blocks == 0
    runner = llm.engine.core.executor.worker.model_runner
    assert len(runner.encoder_cache) == 0


def test_prompt_cache_keyed_by_image(llava_dir):
    """The same image and text reuse every full block; another image with the same text
    reuses only the blocks before the image's first token."""
    llm = LLM(model=llava_dir, dtype="float32", block_size=4, num_kv_blocks=128,
              max_model_len=256)
    kv = llm.engine.core.scheduler.kv_cache_manager
    text = "The quick brown fox jumps over <image> the lazy dog. Paris is the capital"
    cases = [(text, [image(7, (40, 40))]), (text, [image(8, (40, 40))])]
    expected = hf_greedy(llava_dir, cases)
    check_same(run(llm, cases[:1]), expected[:1])
    before = kv.prefix_cache_hits
    check_same(run(llm, cases[:1]), expected[:1])  # same image, same text
    n = len(expected[0][0])
    assert kv.prefix_cache_hits - before == (n - 1) // 4 * 4
    before = kv.prefix_cache_hits
    check_same(run(llm, cases[1:]), expected[1:])  # another image
    image_start = expected[0][0].index(llm.get_tokenizer().convert_tokens_to_ids("<image>"))
    assert image_start >= 4
    assert kv.prefix_cache_hits - before == image_start // 4 * 4


def test_offline_chat_with_image_parts(llava_dir):
    import base64
    import io

    img = image(9, (36, 28))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    llm = LLM(model=llava_dir, dtype="float32", block_size=4, num_kv_blocks=128,
              max_model_len=256)
    out = llm.chat([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "The quick brown"}]}],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    rendered = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "<image>\nThe quick brown"}], tokenize=False,
        add_generation_prompt=True)
    check_same(out, hf_greedy(llava_dir, [(rendered, [img])]))


@pytest.mark.slow
def test_tensor_parallel_2_language_model(llava_dir):
    """TP 2: the language model sharded over two worker processes (the items cross the
    executor's process boundary), the tower replicated; tokens as transformers'."""
    llm = LLM(model=llava_dir, dtype="float32", block_size=4, max_num_batched_tokens=12,
              num_kv_blocks=128, max_model_len=256, tensor_parallel_size=2)
    try:
        check_same(run(llm, CASES), hf_greedy(llava_dir, CASES))
    finally:
        llm.shutdown()


def test_encoder_budget_per_step(llava_dir):
    """One image's encoding per step (16 tokens): two-image prompts stop their chunk before
    the second image; outputs unchanged."""
    llm = LLM(model=llava_dir, dtype="float32", block_size=4, num_kv_blocks=128,
              max_model_len=256, max_num_encoder_tokens_per_step=16)
    check_same(run(llm, CASES), hf_greedy(llava_dir, CASES))
    assert llm.engine.core.scheduler.num_steps > MAX_TOKENS + 2


@pytest.mark.parametrize("flags,name", [
    ({"enable_lora": True}, "--enable_lora"),
    ({"decode_algo": "look_ahead"}, "--decode_algo look_ahead"),
])
def test_unsupported_combinations_are_refused(llava_dir, flags, name):
    with pytest.raises(ValueError, match=name):
        LLM(model=llava_dir, dtype="float32", num_kv_blocks=128, max_model_len=256, **flags)
