"""``--dataset random_mm``: N images per chat request at the given sizes, repeats at the given
ratio, knobs validated before any server is contacted."""

from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image

from bench_fake_server import FakeOpenAIServer
from bladellm.bench.datasets import DatasetConfig, build_dataset
from bladellm.bench.mm_dataset import ImageConfig
from bladellm.entrypoints.cli.bench import main


def _size(url: str) -> tuple[int, int]:
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).size


def test_images_per_request_sizes_and_repeats():
    cfg = DatasetConfig(spec="random_mm", num_prompts=40, input_len_range=(4, 4),
                        images=ImageConfig(num_images=2, sizes=[(16, 8), (9, 12)],
                                           repeat_ratio=0.5))
    reqs = build_dataset(cfg)
    assert all(len(r.images) == 2 for r in reqs)
    urls = [u for r in reqs for u in r.images]
    assert {_size(u) for u in urls} == {(16, 8), (9, 12)}
    repeats = len(urls) - len(set(urls))
    assert 25 <= repeats <= 55  # ~half of 80 draws (the first cannot repeat)
    assert build_dataset(cfg)[0].images == reqs[0].images  # same seed, same images
    none = build_dataset(DatasetConfig(spec="random_mm", num_prompts=10,
                                       images=ImageConfig(sizes=[(8, 8)])))
    urls = [u for r in none for u in r.images]
    assert len(set(urls)) == len(urls)


def test_sends_image_parts_in_chat(tmp_path):
    with FakeOpenAIServer(ttft_s=0.01, itl_s=0.01) as srv:
        assert main(["--base_url", srv.base_url, "--endpoint", "chat", "--dataset", "random_mm",
                     "--num_images", "2", "--image_size", "8x8", "--num_prompts", "3",
                     "--input_len_range", "4,4", "--output_len_range", "2,2",
                     "--output_dir", str(tmp_path / "o"), "--label", "mm",
                     "--disable_tqdm"]) == 0
        content = srv.payloads[-1]["messages"][-1]["content"]
    assert [p["type"] for p in content] == ["image_url", "image_url", "text"]
    assert _size(content[0]["image_url"]["url"]) == (8, 8)
    json.loads((tmp_path / "o" / "mm.json").read_text())


@pytest.mark.parametrize("extra,flag", [
    (["--dataset", "random_mm"], "--dataset random_mm"),  # completions endpoint
    (["--num_images", "2"], "--num_images"),  # with --dataset random
    (["--dataset", "random_mm", "--endpoint", "chat", "--num_images", "0"], "--num_images"),
    (["--dataset", "random_mm", "--endpoint", "chat", "--image_size", "8by8"], "--image_size"),
    (["--dataset", "random_mm", "--endpoint", "chat", "--image_repeat_ratio", "2"],
     "--image_repeat_ratio"),
])
def test_bad_knobs_fail_before_contacting_the_server(tmp_path, capsys, extra, flag):
    with pytest.raises(SystemExit) as exc:
        main(["--base_url", "http://127.0.0.1:9", "--output_dir", str(tmp_path / "out"),
              "--disable_tqdm", *extra])
    assert exc.value.code == 2
    assert f"error: {flag}" in capsys.readouterr().err
