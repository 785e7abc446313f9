"""Model ids (``--model org/name``): fetched into the hub cache, served from the local snapshot.

Hugging Face through ``huggingface_hub.snapshot_download`` (downloads when online; with
``HF_HUB_OFFLINE=1`` only the cache is used; ``--revision`` picks a branch, tag or commit;
``--download_dir`` replaces the default cache directory), or ModelScope through
``modelscope.snapshot_download`` when ``--model_hub modelscope`` is chosen and the package is
installed. Only what serving needs is fetched: configs, tokenizer files and the weights
(safetensors, or pytorch ``.bin`` when the repository has no safetensors).
"""

from __future__ import annotations

import glob
import os
import re

from bladellm import envs

HUBS = ("huggingface", "modelscope")
_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_CONFIG_AND_TOKENIZER = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken", "tokenizer*"]


def is_model_id(model: str) -> bool:
    """``org/name`` that is not an existing local path."""
    return bool(_ID.match(model)) and not os.path.exists(os.path.expanduser(model))


def download_model(model_id: str, revision: str | None, download_dir: str | None,
                   hub: str = "huggingface") -> str:
    """Local directory of ``model_id``; ValueError (naming the flags) when it cannot be had."""
    if hub == "modelscope":
        return _from_modelscope(model_id, revision, download_dir)
    return _from_huggingface(model_id, revision, download_dir)


def _from_huggingface(model_id: str, revision: str | None, download_dir: str | None) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)

    offline = envs.hf_hub_offline()
    where = download_dir or "the Hugging Face cache (HF_HUB_CACHE / ~/.cache/huggingface/hub)"

    def fetch(patterns: list[str]) -> str:
        return snapshot_download(model_id, revision=revision, cache_dir=download_dir,
                                 allow_patterns=patterns, local_files_only=offline)

    try:
        path = fetch(_CONFIG_AND_TOKENIZER + ["*.safetensors"])
        if not glob.glob(os.path.join(path, "*.safetensors")):
            path = fetch(_CONFIG_AND_TOKENIZER + ["*.bin"])
    except LocalEntryNotFoundError as e:
        reason = ("HF_HUB_OFFLINE is set" if offline
                  else "the Hugging Face hub could not be reached")
        raise ValueError(
            f"--model {model_id}: not found in {where} and {reason}; download it first "
            f"(hf download {model_id}{f' --revision {revision}' if revision else ''}) or pass "
            f"a model directory") from e
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise ValueError(f"--model {model_id}: no such model on the Hugging Face hub, or it "
                         f"needs a token (HF_TOKEN): {e}") from e
    except RevisionNotFoundError as e:
        raise ValueError(f"--revision {revision}: not found for {model_id}") from e
    except OSError as e:  # network errors, a full disk
        raise ValueError(f"--model {model_id}: download failed: {e}") from e
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"--model {model_id}: the snapshot in {path} has no config.json")
    return path


def _from_modelscope(model_id: str, revision: str | None, download_dir: str | None) -> str:
    try:
        from modelscope import snapshot_download
    except ImportError:
        raise ValueError("--model_hub modelscope needs the modelscope package: "
                         "pip install modelscope") from None
    try:
        kwargs = {"cache_dir": download_dir}
        if revision is not None:
            kwargs["revision"] = revision
        return snapshot_download(model_id, **kwargs)
    except Exception as e:  # noqa: BLE001 - modelscope raises many unrelated types
        raise ValueError(f"--model {model_id}: ModelScope download failed: {e}") from e
