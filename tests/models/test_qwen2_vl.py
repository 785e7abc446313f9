"""Qwen2-VL and Qwen2.5-VL through the engine vs transformers, float32, greedy: token-identical
outputs with one image, several images of different sizes, image-text-image, text only,
chunked prefill cutting through images with preemption, the prompt cache keyed by image
content, chat image parts, and the vision tower alone against transformers'. M-RoPE decides
every one of these: a wrong position anywhere changes the tokens."""

from __future__ import annotations

import pytest
import torch
import transformers
from PIL import Image

from bladellm import LLM, SamplingParams
from tiny_qwen2_vl import IMAGE, MERGE_SIZE, make_tiny_qwen2_vl

MAX_TOKENS = 8
ARCHS = ["Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"]


@pytest.fixture(scope="module", params=ARCHS)
def vl_dir(request, tmp_path_factory):
    return make_tiny_qwen2_vl(tmp_path_factory.mktemp(request.param), request.param)


def image(seed: int, size: tuple[int, int]) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def hf_model(model_dir: str):
    config = transformers.AutoConfig.from_pretrained(model_dir)
    cls = getattr(transformers, config.architectures[0])
    return cls.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir: str, cases: list[tuple[str, list[Image.Image]]]):
    """(expanded prompt ids, greedy output ids) per case from transformers' image processor and
    generate; each ``<|image_pad|>`` expanded to grid_t * grid_h * grid_w / merge^2 tokens, as
    ``Qwen2VLProcessor`` does (which needs torchvision for its video half)."""
    model = hf_model(model_dir)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    processor = transformers.AutoImageProcessor.from_pretrained(model_dir)
    pad = model.config.image_token_id
    results = []
    with torch.no_grad():
        for text, images in cases:
            ids = tok(text)["input_ids"]
            kwargs = {}
            if images:
                kwargs = dict(processor(images=images, return_tensors="pt"))
                counts = iter((kwargs["image_grid_thw"].prod(-1) // MERGE_SIZE ** 2).tolist())
                ids = [t for i in ids for t in ([i] * next(counts) if i == pad else [i])]
            input_ids = torch.tensor([ids])
            gen = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 mm_token_type_ids=(input_ids == pad).int(), **kwargs,
                                 do_sample=False, max_new_tokens=MAX_TOKENS, pad_token_id=0)
            results.append((ids, gen[0, len(ids):].tolist()))
    return results


CASES = [
    (f"hi {IMAGE} The quick brown fox", [image(1, (56, 40))]),
    # Two images of different sizes and aspect ratios (dynamic resolution: 48 and 33 tokens).
    (f"{IMAGE}{IMAGE} Paris is the capital of", [image(2, (64, 48)), image(3, (20, 90))]),
    # Image, text, image.
    (f"{IMAGE} Once upon a time there was a small engine {IMAGE} that served",
     [image(4, (24, 16)), image(5, (33, 71))]),
    ("Text only: the quick brown fox jumps", []),
]


def run(llm: LLM, cases, **params):
    prompts = [{"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
               for text, imgs in cases]
    return llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                **params), use_tqdm=False)


def check_same(outs, expected):
    for i, (out, (ids, tokens)) in enumerate(zip(outs, expected)):
        assert out.prompt_token_ids == ids, f"case {i}: expanded prompt differs"
        assert out.outputs[0].token_ids == tokens, f"case {i}"


def test_greedy_identical_to_transformers(vl_dir):
    llm = LLM(model=vl_dir, dtype="float32", block_size=4, num_kv_blocks=256,
              max_model_len=256, debug_block_accounting=True)
    runner = llm.engine.core.executor.worker.model_runner
    inner = runner.model.language_model.model
    stack_steps = []  # steps the compiled decoder stack ran (where this machine builds it)
    if inner.compiled_stack is not None:
        stack = inner.compiled_stack
        inner.compiled_stack = lambda h, p, ctx: stack_steps.append(p.dim()) or stack(h, p, ctx)
    check_same(run(llm, CASES), hf_greedy(vl_dir, CASES))
    if stack_steps:  # decode steps (text only) reach it with [T] positions, image steps not
        assert 1 in stack_steps and 2 in stack_steps
    assert len(runner.encoder_cache) == 0  # every entry freed with its requests


def test_chunked_prefill_and_preemption_through_images(vl_dir):
    """Chunks of 4 tokens start inside images (their M-RoPE rows come from the middle of the
    table; steps this small are the ones the compiled decoder stack, which reads [T]
    positions, would take); a small KV pool preempts requests with images in flight, which
    come back and recompute their positions and their images."""
    cases = CASES[:3]
    llm = LLM(model=vl_dir, dtype="float32", block_size=4, max_num_batched_tokens=4,
              max_num_seqs=6, num_kv_blocks=28, max_model_len=104,
              debug_block_accounting=True, disable_prompt_cache=True)
    check_same(run(llm, cases), hf_greedy(vl_dir, cases))
    stats = llm.engine.core.scheduler.get_stats()
    assert stats.num_preemptions > 0
    assert stats.num_used_blocks == 0
    runner = llm.engine.core.executor.worker.model_runner
    assert len(runner.encoder_cache) == 0


def test_prompt_cache_keyed_by_image(vl_dir):
    """The same image and text reuse every full block (the cached tokens' positions are not
    recomputed, yet the decode positions continue from the request's delta); another image of
    the same size with the same text reuses only the blocks before the image."""
    llm = LLM(model=vl_dir, dtype="float32", block_size=4, num_kv_blocks=256,
              max_model_len=256)
    kv = llm.engine.core.scheduler.kv_cache_manager
    text = f"The quick brown fox jumps over {IMAGE} the lazy dog. Paris is the capital"
    cases = [(text, [image(7, (40, 56))]), (text, [image(8, (40, 56))])]
    expected = hf_greedy(vl_dir, cases)
    check_same(run(llm, cases[:1]), expected[:1])
    before = kv.prefix_cache_hits
    check_same(run(llm, cases[:1]), expected[:1])  # same image, same text
    n = len(expected[0][0])
    assert kv.prefix_cache_hits - before == (n - 1) // 4 * 4
    before = kv.prefix_cache_hits
    check_same(run(llm, cases[1:]), expected[1:])  # another image
    pad = llm.get_tokenizer().convert_tokens_to_ids("<|image_pad|>")
    image_start = expected[0][0].index(pad)
    assert image_start >= 4
    assert kv.prefix_cache_hits - before == image_start // 4 * 4


def test_offline_chat_with_image_parts(vl_dir):
    import base64
    import io

    img = image(9, (36, 28))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    llm = LLM(model=vl_dir, dtype="float32", block_size=4, num_kv_blocks=256,
              max_model_len=256)
    out = llm.chat([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "The quick brown"}]}],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    rendered = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": f"{IMAGE}\nThe quick brown"}], tokenize=False,
        add_generation_prompt=True)
    check_same(out, hf_greedy(vl_dir, [(rendered, [img])]))


def test_vision_tower_matches_transformers(vl_dir):
    """The worker's encoder (weights as loaded by the engine) against transformers'
    ``get_image_features`` on the same processed pixels, image by image."""
    llm = LLM(model=vl_dir, dtype="float32", block_size=4, num_kv_blocks=65, max_model_len=256)
    ours = llm.engine.core.executor.worker.model_runner.model
    theirs = hf_model(vl_dir)
    processor = transformers.AutoImageProcessor.from_pretrained(vl_dir)
    for img in (image(10, (64, 48)), image(11, (20, 90)), image(12, (8, 8))):
        enc = processor(images=[img], return_tensors="pt")
        with torch.no_grad():
            expected = theirs.model.get_image_features(**enc).pooler_output[0]
            got = ours.encode_image(dict(enc))
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_tensor_parallel_2_language_model(vl_dir):
    """TP 2: the language model sharded over two worker processes (items and positions cross
    the executor's process boundary), the tower replicated; tokens as transformers'."""
    llm = LLM(model=vl_dir, dtype="float32", block_size=4, max_num_batched_tokens=12,
              num_kv_blocks=256, max_model_len=256, tensor_parallel_size=2)
    try:
        check_same(run(llm, CASES), hf_greedy(vl_dir, CASES))
    finally:
        llm.shutdown()


@pytest.mark.parametrize("flags,name", [
    ({"decode_algo": "look_ahead"}, "--decode_algo look_ahead"),
    ({"pipeline_parallel_size": 2}, "--pipeline_parallel_size"),
])
def test_unsupported_combinations_are_refused(vl_dir, flags, name):
    with pytest.raises(ValueError, match=name):
        LLM(model=vl_dir, dtype="float32", num_kv_blocks=65, max_model_len=256, **flags)


def test_hub_config_and_weight_layouts(vl_dir, tmp_path):
    """The form the hub's checkpoints have (text fields at the top of config.json,
    ``rope_scaling: {type: mrope}``) with weights in transformers 5's names
    (``model.visual.*``, ``model.language_model.*``) gives the same tokens."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(vl_dir, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    text = cfg.pop("text_config")
    rope = text.pop("rope_parameters")
    for key, value in text.items():
        if key not in ("model_type", "architectures"):
            cfg.setdefault(key, value)
    cfg["rope_theta"] = rope["rope_theta"]
    cfg["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    cfg["vision_config"].pop("rope_parameters", None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    weights = load_file(tmp_path / "model.safetensors")
    renamed = {("model." + k if k.startswith("visual.") else
                "model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in weights.items()}
    assert any(k.startswith("model.language_model.") for k in renamed)
    save_file(renamed, tmp_path / "model.safetensors")
    llm = LLM(model=str(tmp_path), dtype="float32", block_size=4, num_kv_blocks=256,
              max_model_len=256)
    check_same(run(llm, CASES[:1]), hf_greedy(vl_dir, CASES[:1]))


def test_prompt_errors(vl_dir):
    """Placeholders without their images, and videos (not supported yet), are refused with a
    message naming the placeholder."""
    llm = LLM(model=vl_dir, dtype="float32", num_kv_blocks=65, max_model_len=256)
    with pytest.raises(ValueError, match="image_pad"):
        llm.generate({"prompt": f"{IMAGE}{IMAGE} two", "multi_modal_data": {
            "image": [image(1, (16, 16))]}}, use_tqdm=False)
    with pytest.raises(ValueError, match="video"):
        llm.generate("<|vision_start|><|video_pad|><|vision_end|> a video", use_tqdm=False)
