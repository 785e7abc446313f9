"""``--dataset random_mm``: random prompts with N random images each (chat endpoint only).

Images are random-noise PNGs (incompressible: the transfer and decode costs of a real photo of
that size) of sizes drawn from ``--image_size``; with ``--image_repeat_ratio r`` each image is,
with probability r, one an earlier request already sent, so the server's encoder cache and
image-aware prompt cache get hits at a known rate.
"""

from __future__ import annotations

import base64
import io
import random
from dataclasses import dataclass, field


@dataclass
class ImageConfig:
    num_images: int = 1
    sizes: list[tuple[int, int]] = field(default_factory=lambda: [(336, 336)])
    repeat_ratio: float = 0.0


def parse_image_sizes(text: str) -> list[tuple[int, int]]:
    """'WxH[,WxH...]' -> [(W, H), ...]; a ValueError naming --image_size otherwise."""
    sizes = []
    for part in str(text).split(","):
        w, sep, h = part.strip().lower().partition("x")
        try:
            size = (int(w), int(h))
        except ValueError:
            raise ValueError(f"--image_size: expected WxH[,WxH...], got {text!r}") from None
        if not sep or min(size) < 1 or max(size) > 8192:
            raise ValueError(f"--image_size: each size must be WxH with 1..8192, got {part!r}")
        sizes.append(size)
    return sizes


def check_image_config(cfg: ImageConfig) -> None:
    if cfg.num_images < 1:
        raise ValueError(f"--num_images: must be >= 1, got {cfg.num_images}")
    if not 0.0 <= cfg.repeat_ratio <= 1.0:
        raise ValueError(f"--image_repeat_ratio: must be in [0, 1], got {cfg.repeat_ratio}")


def random_png_url(rng: random.Random, width: int, height: int) -> str:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(rng.getrandbits(64)).integers(
        0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def draw_images(num_requests: int, cfg: ImageConfig, rng: random.Random) -> list[list[str]]:
    """``cfg.num_images`` data URLs per request; repeats drawn from the images sent before."""
    sent: list[str] = []
    out = []
    for _ in range(num_requests):
        urls = []
        for _ in range(cfg.num_images):
            if sent and rng.random() < cfg.repeat_ratio:
                urls.append(rng.choice(sent))
            else:
                url = random_png_url(rng, *rng.choice(cfg.sizes))
                sent.append(url)
                urls.append(url)
        out.append(urls)
    return out
