"""Benchmark workloads: lists of ``BenchRequest`` built from a spec string.

Specs: ``random``, ``random_mm`` (random prompts with images: ``bench/mm_dataset.py``),
``shared_prefix``, ``sharegpt:FILE``, ``jsonl:FILE``. Token counts are exact
when a tokenizer is given (prompts are re-encoded until they have the asked-for length); without
one, prompts are random words and a word stands in for a token.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from bladellm.bench.mm_dataset import ImageConfig, draw_images

WORDS = (
    "the of and to in is was for on that with as by at from his her they this which have had are "
    "be not or one all were but can when there their time will would more out so about up what "
    "into some them other than then now only could also its after first new two may any these "
    "over most such where through back year much good man way well great before long world day "
    "work life city water house light paper model token engine cache block batch queue server "
    "river stone music garden window market number system people story answer question"
).split()


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass
class BenchRequest:
    """One prompt to send. ``system`` is a shared system prompt (chat: a system message;
    completions: prepended to the prompt). ``prompt_len`` counts tokens of system + prompt."""

    prompt: str
    prompt_len: int
    output_len: int
    system: str | None = None
    # --priority_mix: the request's priority class (0 urgent, 1 the rest); None: no classes.
    priority: int | None = None
    # random_mm: image data URLs sent before the text (prompt_len counts the text only).
    images: list[str] | None = None


@dataclass
class DatasetConfig:
    spec: str = "random"
    num_prompts: int = 100
    input_len_range: tuple[int, int] = (128, 128)
    output_len_range: tuple[int, int] = (128, 128)
    num_groups: int = 4
    prefix_len: int = 512
    seed: int = 0
    images: ImageConfig = field(default_factory=ImageConfig)  # random_mm


def parse_range(text: str, flag: str) -> tuple[int, int]:
    """'A,B' or 'A' -> (A, B); raises ValueError naming the flag."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"{flag}: expected 'A,B' integers, got {text!r}") from None
    if len(values) == 1:
        values = values * 2
    if len(values) != 2 or values[0] < 1 or values[1] < values[0]:
        raise ValueError(f"{flag}: expected 'A,B' with 1 <= A <= B, got {text!r}")
    return values[0], values[1]


DATASETS = ("random", "random_mm", "shared_prefix", "sharegpt:FILE", "jsonl:FILE")


def check_dataset_args(spec: str, num_groups: int = DatasetConfig.num_groups,
                       prefix_len: int = DatasetConfig.prefix_len,
                       input_len_range: tuple[int, int] = DatasetConfig.input_len_range) -> None:
    """Validate ``--dataset`` and its knobs before anything is sent: an unknown dataset, a
    missing file, a ``shared_prefix`` knob given with another dataset, or an
    ``--input_len_range`` with a file dataset (whose prompts are the file's: it would be
    ignored) is a ValueError naming the flag."""
    kind, _, arg = str(spec).partition(":")
    if kind in ("sharegpt", "jsonl"):
        if not arg:
            raise ValueError(f"--dataset: {kind} needs a file, as {kind}:FILE")
        if not os.path.isfile(arg):
            raise ValueError(f"--dataset: no such file {arg!r}")
        if tuple(input_len_range) != DatasetConfig.input_len_range:
            raise ValueError(f"--input_len_range: not used with --dataset {kind}:FILE (the "
                             "prompts are the file's)")
    elif kind not in ("random", "random_mm", "shared_prefix") or arg:
        raise ValueError(f"--dataset: unknown dataset {spec!r} ({', '.join(DATASETS)})")
    if kind == "shared_prefix":
        if num_groups < 1:
            raise ValueError(f"--num_groups: must be >= 1, got {num_groups}")
        if prefix_len < 1:
            raise ValueError(f"--prefix_len: must be >= 1, got {prefix_len}")
        return
    if num_groups != DatasetConfig.num_groups:
        raise ValueError(f"--num_groups: only used with --dataset shared_prefix "
                         f"(got --dataset {spec})")
    if prefix_len != DatasetConfig.prefix_len:
        raise ValueError(f"--prefix_len: only used with --dataset shared_prefix "
                         f"(got --dataset {spec})")


class PromptMaker:
    """Makes text of a given token length, from a tokenizer or from random words."""

    def __init__(self, tokenizer: Tokenizer | None, rng: random.Random):
        self.tokenizer = tokenizer
        self.rng = rng
        self._vocab_ids: list[int] = []
        if tokenizer is not None:
            # Added tokens too: a model's placeholders (LLaVA's ``<image>``) are often added
            # without being "special", and one in random text is a second image placeholder.
            special = set(getattr(tokenizer, "all_special_ids", []) or [])
            special |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
            size = len(tokenizer) if hasattr(tokenizer, "__len__") else tokenizer.vocab_size
            # Skip partial-UTF-8 byte tokens: they decode to U+FFFD, which re-encodes longer.
            ids = list(range(size))
            batch_decode = getattr(tokenizer, "batch_decode", None)
            texts = (batch_decode([[i] for i in ids]) if batch_decode
                     else [tokenizer.decode([i]) for i in ids])
            self._vocab_ids = [i for i, t in zip(ids, texts)
                               if i not in special and "\ufffd" not in t]

    def make(self, num_tokens: int) -> tuple[str, int]:
        """Return (text, its token count)."""
        if self.tokenizer is None:
            return " ".join(self.rng.choice(WORDS) for _ in range(num_tokens)), num_tokens
        return self._make_exact(num_tokens)

    def count(self, text: str) -> int:
        if self.tokenizer is None:
            return len(text.split())
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def _make_exact(self, num_tokens: int) -> tuple[str, int]:
        # decode(random ids) re-encodes to a different length (merges across ids); trim or pad
        # the re-encoded ids and retry until the round trip is stable.
        tok = self.tokenizer
        ids = [self.rng.choice(self._vocab_ids) for _ in range(num_tokens)]
        text = tok.decode(ids)
        for _ in range(16):
            ids = tok.encode(text, add_special_tokens=False)
            if len(ids) == num_tokens:
                return text, num_tokens
            if len(ids) > num_tokens:
                ids = ids[:num_tokens]
            else:
                ids = ids + [self.rng.choice(self._vocab_ids) for _ in range(num_tokens - len(ids))]
            text = tok.decode(ids)
        return text, len(tok.encode(text, add_special_tokens=False))


def load_tokenizer(path: str | None):
    if not path:
        return None
    from transformers import AutoTokenizer  # slow import: only when asked for

    return AutoTokenizer.from_pretrained(path)


def build_dataset(cfg: DatasetConfig, tokenizer: Tokenizer | None = None) -> list[BenchRequest]:
    """Build ``cfg.num_prompts`` requests for ``cfg.spec``; the same seed gives the same list."""
    rng = random.Random(cfg.seed)
    kind, _, arg = cfg.spec.partition(":")
    if kind == "random":
        return _random(cfg, PromptMaker(tokenizer, rng), rng)
    if kind == "random_mm":
        requests = _random(cfg, PromptMaker(tokenizer, rng), rng)
        for req, urls in zip(requests, draw_images(len(requests), cfg.images, rng)):
            req.images = urls
        return requests
    if kind == "shared_prefix":
        return _shared_prefix(cfg, PromptMaker(tokenizer, rng), rng)
    if kind in ("sharegpt", "jsonl"):
        if not arg:
            raise ValueError(f"--dataset: {kind} needs a file, as {kind}:FILE")
        maker = PromptMaker(tokenizer, rng)
        rows = _sharegpt_rows(arg) if kind == "sharegpt" else _jsonl_rows(arg)
        return _from_rows(rows, cfg, maker, rng, kind)
    raise ValueError(f"--dataset: unknown dataset {cfg.spec!r} ({', '.join(DATASETS)})")


def _random(cfg: DatasetConfig, maker: PromptMaker, rng: random.Random) -> list[BenchRequest]:
    out = []
    for _ in range(cfg.num_prompts):
        text, n = maker.make(rng.randint(*cfg.input_len_range))
        out.append(BenchRequest(text, n, rng.randint(*cfg.output_len_range)))
    return out


def _shared_prefix(cfg: DatasetConfig, maker: PromptMaker,
                   rng: random.Random) -> list[BenchRequest]:
    if cfg.num_groups < 1 or cfg.prefix_len < 1:
        raise ValueError("--num_groups and --prefix_len must be >= 1")
    prefixes = [maker.make(cfg.prefix_len) for _ in range(cfg.num_groups)]
    out = []
    for i in range(cfg.num_prompts):
        system, system_len = prefixes[i % cfg.num_groups]
        text, n = maker.make(rng.randint(*cfg.input_len_range))
        out.append(BenchRequest(text, system_len + n, rng.randint(*cfg.output_len_range), system))
    rng.shuffle(out)  # groups interleave, as independent users of a few system prompts would
    return out


# A malformed file is a ValueError naming "--dataset KIND:PATH" and where in it: it was a
# traceback (AttributeError, JSONDecodeError) or, for output_len <= 0, HTTP 400 on every request.
def _sharegpt_rows(path: str) -> list[dict[str, Any]]:
    where = f"--dataset sharegpt:{path}"
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc})") from None
    if not isinstance(data, list):
        raise ValueError(f"{where}: expected a JSON list of conversations, "
                         f"got {type(data).__name__}")
    rows = []
    for i, item in enumerate(data):
        turns = ((item.get("conversations") or item.get("conversation") or [])
                 if isinstance(item, dict) else None)
        if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
            raise ValueError(f"{where}: item {i} is not {{\"conversations\": [{{\"value\": "
                             "...}}, ...]}}")
        if len(turns) < 2:
            continue
        rows.append({"prompt": turns[0].get("value", ""), "completion": turns[1].get("value", "")})
    return rows


def _jsonl_rows(path: str) -> list[dict[str, Any]]:
    where = f"--dataset jsonl:{path}"
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: line {lineno} is not JSON ({exc})") from None
            if not isinstance(row, dict) or "prompt" not in row:
                raise ValueError(f"{where}: line {lineno} has no 'prompt'")
            out_len = row.get("output_len")
            if out_len is not None and not (isinstance(out_len, int)
                                            and not isinstance(out_len, bool) and out_len >= 1):
                raise ValueError(f"{where}: line {lineno}: output_len must be an integer >= 1, "
                                 f"got {out_len!r}")
            rows.append(row)
    return rows


def _from_rows(rows: list[dict[str, Any]], cfg: DatasetConfig, maker: PromptMaker,
               rng: random.Random, kind: str) -> list[BenchRequest]:
    """Rows carry 'prompt' and optionally 'system', 'output_len' or a reference 'completion'
    (whose length becomes output_len). Rows are sampled (with replacement if too few)."""
    if not rows:
        raise ValueError(f"--dataset {cfg.spec}: no usable rows")
    out = []
    order = list(range(len(rows)))
    rng.shuffle(order)
    for i in range(cfg.num_prompts):
        row = rows[order[i % len(order)]]
        system = row.get("system")
        prompt_len = maker.count(row["prompt"]) + (maker.count(system) if system else 0)
        if "output_len" in row:
            output_len = int(row["output_len"])
        elif row.get("completion"):
            output_len = max(1, maker.count(row["completion"]))
        else:
            output_len = rng.randint(*cfg.output_len_range)
        out.append(BenchRequest(row["prompt"], prompt_len, output_len, system))
    return out


def assign_priority_classes(requests: Sequence[BenchRequest], mix: float,
                            rng: random.Random) -> None:
    """``--priority_mix``: round(mix * n) requests, drawn at random, get priority 0 (lower is
    served first, as in vLLM), the others priority 1."""
    if not 0 < mix < 1:
        raise ValueError(f"--priority_mix: the fraction of requests at priority 0 must be in "
                         f"(0, 1), got {mix}")
    urgent = set(rng.sample(range(len(requests)), round(mix * len(requests))))
    for i, req in enumerate(requests):
        req.priority = 0 if i in urgent else 1
