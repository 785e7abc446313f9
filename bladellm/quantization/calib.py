"""Calibration data for ``blade_llm_quantize``: text -> token chunks.

``--calib_data`` is a file or the text itself. A ``.jsonl`` file holds one JSON object per line
with a ``"text"`` field; any other file is plain text, one sample per paragraph (blank-line
separated), or per line when it has no blank lines. The samples are tokenized, joined with the
tokenizer's EOS token in between, and cut into consecutive chunks of ``--calib_data_max_len``
tokens; the first ``--num_calib_samples`` chunks are used (the last one may be shorter).
"""

from __future__ import annotations

import json
import os
import re

import torch

_FILE_SUFFIXES = (".txt", ".jsonl", ".json", ".md", ".text")


def load_calibration_texts(calib_data: str) -> list[str]:
    path = os.path.expanduser(calib_data)
    if os.path.isdir(path):
        raise ValueError(f"--calib_data: {calib_data} is a directory; pass a .txt or .jsonl file")
    if os.path.isfile(path):
        try:
            if path.endswith(".jsonl"):
                return _read_jsonl(path)
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as e:  # a ValueError whose message names no flag
            raise ValueError(f"--calib_data: {calib_data} is not UTF-8 text ({e})") from e
        parts = re.split(r"\n\s*\n", text) if re.search(r"\n\s*\n", text) else text.splitlines()
        texts = [p.strip() for p in parts if p.strip()]
    elif "\n" not in calib_data and (calib_data.endswith(_FILE_SUFFIXES) or
                                     os.sep in calib_data and " " not in calib_data):
        raise ValueError(f"--calib_data: file {calib_data} not found (a literal calibration "
                         f"text would not look like a path)")
    else:
        texts = [calib_data.strip()] if calib_data.strip() else []
    if not texts:
        raise ValueError(f"--calib_data: no text in {calib_data!r}")
    return texts


def _read_jsonl(path: str) -> list[str]:
    texts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"--calib_data: {path}:{lineno} is not JSON: {e}") from e
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise ValueError(f"--calib_data: {path}:{lineno} has no string field 'text'")
            if obj["text"].strip():
                texts.append(obj["text"])
    return texts


def tokenize_calibration(tokenizer, texts: list[str], max_len: int,
                         num_samples: int) -> list[torch.Tensor]:
    """Chunks ``[1, <= max_len]`` of the joined token stream (see the module docstring)."""
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    for i, text in enumerate(texts):
        if i:
            stream.extend(sep)
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(stream) >= max_len * num_samples:
            break
    chunks = [stream[i:i + max_len] for i in range(0, len(stream), max_len)][:num_samples]
    chunks = [c for c in chunks if len(c) >= 2]
    if not chunks:
        raise ValueError("--calib_data: the calibration text has fewer than 2 tokens")
    return [torch.tensor([c], dtype=torch.long) for c in chunks]
