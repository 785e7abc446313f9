"""M-RoPE without a model: the prompt positions against transformers' ``get_rope_index``, the
rotary layer against transformers' multimodal rotary, and the worker's per-step [3, T]
positions for chunks that start inside an image and for decode tokens."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
from transformers.models.qwen2_vl import modeling_qwen2_vl as hf

from bladellm.kernels import Kernels, resolve_kernels
from bladellm.kernels.scope import building_with
from bladellm.model.layers.mrope import MRotaryEmbedding, mrope_parameters
from bladellm.model.layers.rotary import RotaryEmbedding
from bladellm.multimodal.inputs import MultiModalItem, TensorData
from bladellm.multimodal.mrope import mrope_positions
from bladellm.worker.mrope_positions import MRopePositions

MERGE = 2
PAD = 9  # the image token in these prompts


def image_item(offset: int, grid: tuple[int, int, int]) -> MultiModalItem:
    t, h, w = grid
    return MultiModalItem(
        modality="image", hash=f"{offset}", offset=offset, length=t * h * w // MERGE ** 2,
        tensors={"image_grid_thw": TensorData.of(np.array([grid], np.int64))})


def layout(parts: list) -> tuple[list[int], list[MultiModalItem]]:
    """Token ids and items for parts that are a text length (int) or an image grid (tuple)."""
    ids: list[int] = []
    items = []
    for part in parts:
        if isinstance(part, int):
            ids += [1] * part
        else:
            items.append(image_item(len(ids), part))
            ids += [PAD] * items[-1].length
    return ids, items


def transformers_rope_index(ids: list[int], items: list[MultiModalItem]):
    fake = SimpleNamespace(
        config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=MERGE)),
        get_vision_position_ids=lambda *a, **k: hf.Qwen2VLModel.get_vision_position_ids(
            None, *a, **k))
    input_ids = torch.tensor([ids])
    grids = torch.from_numpy(np.concatenate([it.tensors["image_grid_thw"].numpy()
                                             for it in items])) if items else None
    positions, delta = hf.Qwen2VLModel.get_rope_index(
        fake, input_ids, (input_ids == PAD).int(), image_grid_thw=grids)
    return positions[:, 0].numpy(), int(delta[0, 0])


@pytest.mark.parametrize("parts", [
    [5, (1, 4, 6), 3],  # text, a wide image, text
    [(1, 8, 2), 4],  # a tall image first
    [2, (1, 4, 4), 2, (1, 2, 6), 1],  # two images, <|vision_end|><|vision_start|> between
    [3, (1, 6, 4), 5, (1, 2, 2)],  # ends with an image
    [7],  # text only
])
def test_positions_match_transformers_get_rope_index(parts):
    ids, items = layout(parts)
    ours, delta = mrope_positions(len(ids), items, MERGE)
    theirs, their_delta = transformers_rope_index(ids, items)
    np.testing.assert_array_equal(ours, theirs)
    assert delta == their_delta


def test_grid_that_does_not_match_the_span_is_refused():
    bad = MultiModalItem(modality="image", hash="x", offset=0, length=5,
                         tensors={"image_grid_thw": TensorData.of(np.array([[1, 4, 4]]))})
    with pytest.raises(ValueError, match="grid"):
        mrope_positions(8, [bad], MERGE)


@pytest.mark.parametrize("kernel_set", ["ref", "auto", "triton"])
def test_rotary_matches_transformers_multimodal_rotary(kernel_set):
    """The reference kernels, this machine's CPU set (compiled where it builds) and Triton (its
    interpreter without a GPU): the gathered per-token table goes through the ordinary rotary
    kernel of each."""
    if kernel_set == "triton":
        pytest.importorskip("triton")
        if torch.cuda.is_available():
            pytest.skip("the layer's tensors here are on the CPU")
    kernels = {"ref": Kernels, "auto": lambda: resolve_kernels("auto", "cpu"),
               "triton": lambda: resolve_kernels("triton", "cpu")}[kernel_set]()
    head_dim, section = 16, [2, 3, 3]
    text = transformers.Qwen2VLTextConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "mrope_section": section})
    params, sec = mrope_parameters(text)
    with building_with(kernels):
        rope = MRotaryEmbedding(head_dim, params, 128, torch.float32, sec)
        plain = RotaryEmbedding(head_dim, params, 128, torch.float32)
    T = 11
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 100, (3, T), generator=g)
    q, k = torch.randn(T, 4 * head_dim, generator=g), torch.randn(T, 2 * head_dim, generator=g)
    got_q, got_k = rope(positions, q, k)
    cos, sin = hf.Qwen2VLRotaryEmbedding(text)(q, positions[:, None, :])
    want_q, want_k = hf.apply_rotary_pos_emb(q.view(1, T, 4, head_dim).transpose(1, 2),
                                             k.view(1, T, 2, head_dim).transpose(1, 2),
                                             cos, sin)
    torch.testing.assert_close(got_q, want_q.transpose(1, 2).reshape(T, -1))
    torch.testing.assert_close(got_k, want_k.transpose(1, 2).reshape(T, -1))
    # Equal rows (text) are the plain rotary embedding, and so are 1-D positions.
    same = positions[:1].expand(3, T)
    for pos in (same, positions[0]):
        torch.testing.assert_close(rope(pos, q, k)[0], plain(positions[0], q, k)[0])


def test_mrope_parameters_read_old_configs_and_refuse_missing_sections():
    old = SimpleNamespace(rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                          rope_theta=1e6, max_position_embeddings=64)
    params, section = mrope_parameters(old)
    assert params["rope_type"] == "default" and params["rope_theta"] == 1e6
    assert section == [2, 3, 3]
    with pytest.raises(ValueError, match="mrope_section"):
        mrope_parameters(SimpleNamespace(rope_parameters={"rope_type": "default"},
                                         max_position_embeddings=64))


def test_step_positions_for_chunks_and_decodes():
    """Request a: a chunk starting inside its image; b: decoding past its prompt (p + delta);
    c: no image (its three rows are the flat positions)."""
    ids, items = layout([3, (1, 4, 6), 2])  # 3 text, 6 image tokens (2x3), 2 text: P = 11
    table, delta = mrope_positions(len(ids), items, MERGE)
    assert delta == 3 + 3 + 2 - 11  # the image spans max(2, 3) positions for its 6 tokens
    mrope = MRopePositions(lambda n, its: mrope_positions(n, its, MERGE))
    for req_id in ("a", "b"):
        mrope.add_request(SimpleNamespace(req_id=req_id, num_prompt_tokens=len(ids),
                                          mm_items=items))
    mrope.add_request(SimpleNamespace(req_id="c", num_prompt_tokens=4, mm_items=[]))
    flat = np.array([5, 6, 7, 8, 11, 12, 30], np.int64)  # a: 5..8, b: 11, 12, c: 30
    qsl = np.array([0, 4, 6, 7], np.int32)
    inputs = SimpleNamespace(req_ids=["a", "b", "c"], positions=torch.from_numpy(flat),
                             attn_metadata=SimpleNamespace(query_start_loc_cpu=qsl))
    out = mrope.positions(inputs).numpy()
    assert out.shape == (3, 7)
    np.testing.assert_array_equal(out[:, :4], table[:, 5:9])
    np.testing.assert_array_equal(out[:, 4:6], np.array([[11, 12]] * 3) + delta)
    np.testing.assert_array_equal(out[:, 6], [30, 30, 30])
    mrope.remove_requests(["a", "b", "c"])
    assert mrope.delta("a") == 0
