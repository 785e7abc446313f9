"""``blade_llm_split``: pre-split a checkpoint for ``--tensor_parallel_size T`` and
``--pipeline_parallel_size P`` (docs/parallel.md).

    blade_llm_split -tp 2 -pp 2 --model /models/llama --output_dir /models/llama-tp2-pp2
    blade_llm_server --model /models/llama-tp2-pp2 -tp 2 -pp 2

Writes ``OUT/rank_{r}/model.safetensors`` for r in 0..T*P-1 (``r = stage * T + tp_rank``):
exactly the parameters rank ``r`` holds (its stage's layers, its TP shards), under the engine's
own names (fused ``qkv_proj`` / ``gate_up_proj``) and shard shapes, plus the source's config,
tokenizer and generation config, and ``OUT/bladellm_split.json`` (the manifest, written last: an
interrupted split is not loadable, and removes what it wrote). The shards are made by building
the model once per rank in this process with the TP rank and size faked
(``parallel_state.tp_shape_for_split``: no process group, no collective) and loading the full
checkpoint through the layers' ordinary weight loaders, so a split shard is byte for byte what
a rank would have loaded itself.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from typing import Any

import torch

from bladellm.entrypoints.cli.output_dir import first_missing, same_dir

logger = logging.getLogger("bladellm.split")

# Top-level files of the source that are weights (not copied); everything else (config,
# tokenizer, generation config, chat template, README, ...) is copied to the output directory.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="blade_llm_split", allow_abbrev=False,
        description="Split a checkpoint into one directory per rank, OUT/rank_{r} for r = "
                    "stage * T + tp_rank (its pipeline stage's layers, its tensor-parallel "
                    "shards), which blade_llm_server --model OUT --tensor_parallel_size T "
                    "--pipeline_parallel_size P loads with each rank reading only its own "
                    "directory.")
    parser.add_argument("--model", required=True,
                        help="Source model directory (Hugging Face layout) or hub model id.")
    parser.add_argument("--output_dir", required=True, help="Directory to write the split to.")
    parser.add_argument("--tensor_parallel_size", "-tp", type=int, required=True,
                        help="Number of tensor-parallel ranks to split for.")
    parser.add_argument("--pipeline_parallel_size", "-pp", type=int, default=1,
                        help="Number of pipeline stages to split for (each stage's ranks get "
                             "only its layers).")
    parser.add_argument("--dtype", default="auto", choices=["auto", *_DTYPE_NAMES],
                        help="dtype of the written shards, also written to the split's "
                             "config.json (what the server's --dtype auto serves); auto keeps "
                             "the checkpoint's dtype (float32 if the config names none).")
    parser.add_argument("--trust_remote_code", action="store_true",
                        help="Allow model code from the model directory.")
    parser.add_argument("--load_format", default="auto", choices=["auto", "safetensors", "pt"],
                        help="Source weight format.")
    parser.add_argument("--enable_expert_parallel", "--enable-expert-parallel",
                        action="store_true",
                        help="Mixture-of-experts models: split whole experts over the "
                             "tensor-parallel ranks (serve with --enable_expert_parallel) "
                             "instead of each expert's intermediate size.")
    parser.add_argument("--overwrite", action="store_true",
                        help="Write into a non-empty --output_dir (its rank_* directories and "
                             "manifest are replaced).")
    return parser


def _checkpoint_dtype(hf_config: Any, dtype: str) -> torch.dtype:
    if dtype != "auto":
        return _DTYPE_NAMES[dtype]
    cfg = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(cfg, str):
        cfg = getattr(torch, cfg, None)
    return cfg if cfg in _DTYPE_NAMES.values() else torch.float32


def _check_source(model_dir: str) -> None:
    from bladellm.model.loader import SPLIT_MANIFEST

    if os.path.isfile(os.path.join(model_dir, SPLIT_MANIFEST)):
        raise ValueError(f"--model: {model_dir} is already split ({SPLIT_MANIFEST}); split the "
                         f"original checkpoint instead")
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--model: cannot read {path}: {e}") from e


def _prepare_output(output_dir: str, overwrite: bool) -> None:
    from bladellm.model.loader import SPLIT_MANIFEST

    if os.path.isfile(output_dir):
        raise ValueError(f"--output_dir: {output_dir} is a file")
    if os.path.isdir(output_dir) and os.listdir(output_dir):
        if not overwrite:
            raise ValueError(f"--output_dir: {output_dir} is not empty; pass --overwrite to "
                             f"write into it anyway")
        manifest = os.path.join(output_dir, SPLIT_MANIFEST)
        if os.path.exists(manifest):
            os.remove(manifest)  # first: a half-rewritten split must not look loadable
        for name in os.listdir(output_dir):
            if name.startswith("rank_") and os.path.isdir(os.path.join(output_dir, name)):
                shutil.rmtree(os.path.join(output_dir, name))
    try:
        os.makedirs(output_dir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--output_dir: cannot create {output_dir}: {e}") from e


def _copy_side_files(src: str, dst: str) -> list[str]:
    copied = []
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if not os.path.isfile(path) or name in _WEIGHT_INDEXES or \
                name.endswith(_WEIGHT_SUFFIXES):
            continue
        shutil.copy2(path, os.path.join(dst, name))
        copied.append(name)
    return copied


def _set_config_dtype(path: str, torch_dtype: torch.dtype) -> None:
    """The copied config names the shards' dtype: with the source's, ``--dtype auto`` would
    serve e.g. a ``--dtype bfloat16`` split widened back to the source's float32."""
    with open(path) as f:
        config = json.load(f)
    name = str(torch_dtype).removeprefix("torch.")
    config["torch_dtype"] = name  # transformers < 5 reads torch_dtype, 5 reads dtype
    if "dtype" in config:
        config["dtype"] = name
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def split_checkpoint(model: str, output_dir: str, tensor_parallel_size: int, *,
                     dtype: str = "auto", trust_remote_code: bool = False,
                     load_format: str = "auto", overwrite: bool = False,
                     pipeline_parallel_size: int = 1,
                     enable_expert_parallel: bool = False) -> dict[str, Any]:
    """Write the split of ``model`` for ``tensor_parallel_size`` ranks to ``output_dir``;
    returns the manifest. Every bad input is a ``ValueError`` naming the flag, raised before
    ``output_dir`` is made; a run that fails later removes what it made."""
    from bladellm.config import ModelConfig
    from bladellm.model.parallel_fit import check_pipeline_parallel, check_tensor_parallel
    from bladellm.model.loader import resolve_model
    from bladellm.model.loader import SPLIT_MANIFEST, find_weight_files
    from bladellm.model.registry import get_model_class
    from bladellm.quantization import get_quant_config

    output_dir = os.path.expanduser(output_dir)  # as --model: `--output_dir=~/x` is unexpanded
    tp = tensor_parallel_size
    if tp < 1:
        raise ValueError(f"--tensor_parallel_size: must be >= 1, got {tp}")
    pp = pipeline_parallel_size
    if pp < 1:
        raise ValueError(f"--pipeline_parallel_size: must be >= 1, got {pp}")
    if model.endswith(".gguf"):
        raise ValueError(f"--model {model}: GGUF checkpoints are quantized; blade_llm_split "
                         f"supports float checkpoint directories only for now")
    if model == "demo":  # its dense copy is a float checkpoint directory
        from bladellm.checkpoint.demo import demo_hf_dir

        model = demo_hf_dir()
    src_dir = os.path.expanduser(model)
    if os.path.isdir(src_dir):
        _check_source(src_dir)
    resolved = resolve_model(ModelConfig(model=model, trust_remote_code=trust_remote_code,
                                         load_format=load_format, dtype="float32"))
    src_dir = resolved.path
    _check_source(src_dir)  # again, for a hub id now downloaded
    hf_config = resolved.hf_config
    if enable_expert_parallel and tp < 2:
        raise ValueError("--enable_expert_parallel: needs --tensor_parallel_size > 1: the "
                         "experts are split over the tensor-parallel ranks")
    check_tensor_parallel(hf_config, tp, expert_parallel=enable_expert_parallel)
    check_pipeline_parallel(hf_config, pp)
    # realpath: a link to the model is the model (we would write rank_* into the source, then
    # fail copying its files onto themselves)
    if same_dir(output_dir, src_dir):
        raise ValueError("--output_dir must differ from --model")
    # Everything about the source is checked before --output_dir is made. The loader's and
    # registry's messages are the server's: they get our flag's name, and the loader's hint
    # (--load_format dummy) goes, as blade_llm_split does not take it.
    try:
        files = find_weight_files(src_dir, load_format)
    except ValueError as e:
        msg = str(e).replace("; use --load_format dummy for random weights", "")
        raise ValueError(f"--model: {msg} (--load_format {load_format})") from e
    try:
        # A quantized checkpoint is split as its packed tensors (each rank's shard on group and
        # pack boundaries, as a rank would load it); the rank unpacks them when it loads it.
        quant_config = get_quant_config(hf_config)
        model_cls = get_model_class(hf_config)
    except ValueError as e:
        raise ValueError(str(e) if str(e).startswith("--") else f"--model: {e}") from e
    source_bytes = sum(os.path.getsize(p) for p in files)
    torch_dtype = _checkpoint_dtype(hf_config, dtype)
    created = first_missing(output_dir)
    try:
        _prepare_output(output_dir, overwrite)
        return _write_split(model, src_dir, output_dir, files, hf_config, quant_config,
                            model_cls, torch_dtype, tp, pp, source_bytes,
                            enable_expert_parallel)
    except BaseException:
        # What this run made goes: the directories it created, or the rank_* directories it
        # wrote into an existing --output_dir (no manifest yet, so nothing loadable is lost).
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        elif os.path.isdir(output_dir) and not os.path.exists(
                os.path.join(output_dir, SPLIT_MANIFEST)):
            for name in os.listdir(output_dir):
                if name.startswith("rank_"):
                    shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
        raise


def _write_split(model: str, src_dir: str, output_dir: str, files: list[str], hf_config: Any,
                 quant_config: Any, model_cls: Any, torch_dtype: torch.dtype, tp: int, pp: int,
                 source_bytes: int, expert_parallel: bool = False) -> dict[str, Any]:
    from safetensors.torch import save_file

    from bladellm.attention import get_attn_backend
    from bladellm.distributed.parallel_state import tp_shape_for_split
    from bladellm.kernels import Kernels
    from bladellm.kernels.scope import building_with
    from bladellm.model.loader import (SPLIT_FORMAT, SPLIT_FORMAT_VERSION, SPLIT_MANIFEST,
                                       load_checkpoint_files, split_rank_dir, split_state_dict)

    reference = Kernels()  # construction only: nothing runs
    attn_backend = get_attn_backend("torch", reference)
    if quant_config is not None:
        quant_config = quant_config.for_model(model_cls.packed_modules_mapping)
    ranks = []
    for rank in range(tp * pp):  # the workers' rank order: pp_rank * tp + tp_rank
        start = time.perf_counter()
        with tp_shape_for_split(rank % tp, tp, rank // tp, pp, expert_parallel), \
                torch.device("cpu"), \
                building_with(reference):
            shard = model_cls(hf_config, torch_dtype, attn_backend, quant_config)
            load_checkpoint_files(shard, files)
        state = split_state_dict(shard)
        del shard
        rank_dir = split_rank_dir(output_dir, rank)
        os.makedirs(rank_dir, exist_ok=True)
        path = os.path.join(rank_dir, "model.safetensors")
        save_file(state, path, metadata={"format": "pt", "bladellm_split_rank": str(rank),
                                         "tensor_parallel_size": str(tp),
                                         "pipeline_parallel_size": str(pp)})
        size = os.path.getsize(path)
        ranks.append({"dir": os.path.basename(rank_dir), "files": ["model.safetensors"],
                      "bytes": size, "num_tensors": len(state)})
        del state
        logger.info("rank %d/%d: %s, %.1f MB (%.0f%% of the source) in %.1f s", rank, tp * pp,
                    path, size / 1e6, 100 * size / max(source_bytes, 1),
                    time.perf_counter() - start)
    copied = _copy_side_files(src_dir, output_dir)
    _set_config_dtype(os.path.join(output_dir, "config.json"), torch_dtype)
    manifest = {
        "format": SPLIT_FORMAT,
        "format_version": SPLIT_FORMAT_VERSION,
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "enable_expert_parallel": expert_parallel,
        "source": os.path.abspath(src_dir) if os.path.isdir(src_dir) else model,
        "architecture": (getattr(hf_config, "architectures", None) or ["?"])[0],
        "dtype": str(torch_dtype).removeprefix("torch."),
        "source_weight_bytes": source_bytes,
        "ranks": ranks,
        "copied_files": copied,
    }
    tmp = os.path.join(output_dir, SPLIT_MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2)
    os.replace(tmp, os.path.join(output_dir, SPLIT_MANIFEST))
    return manifest


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    ns = make_parser().parse_args(argv)
    try:
        manifest = split_checkpoint(
            ns.model, ns.output_dir, ns.tensor_parallel_size, dtype=ns.dtype,
            trust_remote_code=ns.trust_remote_code, load_format=ns.load_format,
            overwrite=ns.overwrite, pipeline_parallel_size=ns.pipeline_parallel_size,
            enable_expert_parallel=ns.enable_expert_parallel)
    except ValueError as exc:
        print(f"blade_llm_split: error: {exc}", file=sys.stderr)
        return 2
    src = manifest["source_weight_bytes"]
    for r in manifest["ranks"]:
        print(f"{ns.output_dir}/{r['dir']}: {r['bytes']} bytes "
              f"({100 * r['bytes'] / max(src, 1):.1f}% of {src})")
    tp, pp = manifest["tensor_parallel_size"], manifest["pipeline_parallel_size"]
    ep = " --enable_expert_parallel" if manifest["enable_expert_parallel"] else ""
    print(f"split for --tensor_parallel_size {tp} --pipeline_parallel_size {pp}{ep}; serve "
          f"with: blade_llm_server --model {ns.output_dir} --tensor_parallel_size {tp} "
          f"--pipeline_parallel_size {pp}{ep}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
