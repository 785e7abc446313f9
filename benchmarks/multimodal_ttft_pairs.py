"""TTFT of a prompt-cache miss and hit through an image, interleaved request by request.

    python benchmarks/multimodal_ttft_pairs.py --base_url http://127.0.0.1:8081 --out PAIRS.json

One request at a time, alternating: a new random image + new text (a miss: the image is encoded
and the whole prompt prefilled), then one shared image + new text (the blocks through the image
are in the prompt cache: the server reports them as ``cached_tokens``). Alternating request by
request makes the two sides see the same machine load, which on a shared machine drifts more
between consecutive runs than the effect being measured. TTFT is the time to a 1-token answer.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import statistics
import time


def image_url(seed: int, size: tuple[int, int]) -> str:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base_url", default="http://127.0.0.1:8081")
    p.add_argument("--model", default="vlm")
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--words", type=int, default=60, help="random words of text per request")
    p.add_argument("--image_size", default="336x336")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import openai

    client = openai.OpenAI(base_url=args.base_url + "/v1", api_key="x", max_retries=0)
    size = tuple(int(x) for x in args.image_size.lower().split("x"))
    rng = random.Random(args.seed)
    vocab = [f"w{i}" for i in range(2000)]

    def ask(url: str) -> dict:
        text = " ".join(rng.choices(vocab, k=args.words))
        t0 = time.perf_counter()
        r = client.chat.completions.create(model=args.model, max_tokens=1, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}])
        details = r.usage.prompt_tokens_details
        return {"ttft_s": time.perf_counter() - t0, "prompt_tokens": r.usage.prompt_tokens,
                "cached_tokens": details.cached_tokens if details else None}

    shared = image_url(args.seed * 1000 + 999, size)
    ask(shared)  # caches the shared image's blocks; also warms the server up
    miss, hit = [], []
    for i in range(args.pairs):
        miss.append(ask(image_url(args.seed * 1000 + i, size)))
        hit.append(ask(shared))
    med = {k: statistics.median(x["ttft_s"] for x in v) for k, v in (("miss", miss),
                                                                      ("hit", hit))}
    result = {"miss": miss, "hit": hit, "median_ttft_s": med,
              "ratio": med["hit"] / med["miss"]}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(f"median TTFT miss {med['miss'] * 1e3:.0f} ms, hit {med['hit'] * 1e3:.0f} ms "
          f"({result['ratio']:.2f}x); cached tokens on a hit: "
          f"{sorted({x['cached_tokens'] for x in hit})} of {hit[0]['prompt_tokens']}")


if __name__ == "__main__":
    main()
