"""Validated configuration: one dataclass per concern.

Every field carries ``metadata={"help": ...}``; the CLI (``bladellm.entrypoints.cli.args``) is
generated from these dataclasses, so a new flag is a new documented field here. A bad value raises
``ValueError`` naming the flag (``--max_num_seqs``), never a bare assert.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

_DTYPES = ("auto", "float32", "bfloat16", "float16")


def _flag(name: str) -> str:
    return f"--{name}"


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{_flag(name)}: {msg}")


def parse_size(value: int | str) -> int:
    """Parse a byte size such as ``4GiB``, ``512MB``, ``1073741824``."""
    if isinstance(value, int):
        return value
    text = str(value).strip().lower().replace("ib", "").replace("b", "")
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(float(text))


@dataclass
class ModelConfig:
    model: str = field(
        default="demo",
        metadata={"help": "Model directory (Hugging Face / ModelScope layout), a .gguf file, "
                          "or 'demo' for the built-in SmolLM2-135M-Instruct."})
    tokenizer: str | None = field(
        default=None, metadata={"help": "Tokenizer directory; defaults to --model."})
    dtype: str = field(
        default="auto",
        metadata={"help": "Weight and activation dtype: auto, float32, bfloat16 or float16. "
                          "auto keeps a float32 checkpoint in float32; a bfloat16/float16 "
                          "checkpoint runs in bfloat16 on CPUs with native bf16 (AVX512_BF16 "
                          "or AMX) and in float32 on others, where bf16 is emulated and "
                          "several times slower. An explicit value always wins."})
    max_model_len: int | None = field(
        default=None,
        metadata={"help": "Longest prompt + output in tokens; defaults to the model's "
                          "max_position_embeddings."})
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow model code from the model directory."})
    served_model_name: str | None = field(
        default=None, metadata={"help": "Model name in the API; defaults to the directory name."})
    seed: int = field(default=0, metadata={"help": "Seed for unseeded sampling."})
    attn_cls: str = field(
        default="auto",
        metadata={"help": "Attention backend: auto / paged (paged-attention kernels compiled "
                          "for this CPU's ISA; the PyTorch reference if they cannot be built) "
                          "or torch (the plain-PyTorch reference twins)."})
    revision: str | None = field(
        default=None,
        metadata={"help": "For a hub model id: the branch, tag or commit to serve (default: "
                          "the main branch)."})
    download_dir: str | None = field(
        default=None,
        metadata={"help": "For a hub model id: the cache directory to download into and read "
                          "from (default: the hub's own cache, e.g. ~/.cache/huggingface/hub)."})
    model_hub: str = field(
        default="huggingface",
        metadata={"help": "Where a model id (org/name) comes from: huggingface or modelscope "
                          "(needs pip install modelscope)."})
    load_format: str = field(
        default="auto",
        metadata={"help": "auto (safetensors, then pytorch .bin), safetensors, pt, gguf, or "
                          "dummy (random weights, for benchmarks)."})

    def __post_init__(self) -> None:
        _check(bool(self.model), "model", "must not be empty")
        _check(self.dtype in _DTYPES, "dtype", f"must be one of {_DTYPES}, got {self.dtype!r}")
        _check(self.max_model_len is None or self.max_model_len > 0, "max_model_len",
               f"must be positive, got {self.max_model_len}")
        _check(self.attn_cls in ("auto", "paged", "torch"), "attn_cls",
               f"unknown attention backend {self.attn_cls!r}; supported: auto, paged, torch")
        _check(self.model_hub in ("huggingface", "modelscope"), "model_hub",
               f"must be huggingface or modelscope, got {self.model_hub!r}")
        _check(self.load_format in ("auto", "safetensors", "pt", "gguf", "dummy"), "load_format",
               f"unknown format {self.load_format!r}")


@dataclass
class CacheConfig:
    block_size: int = field(
        default=16, metadata={"help": "Tokens per KV-cache block."})
    kv_cache_memory: str = field(
        default="auto",
        metadata={"help": "CPU: memory for the KV cache, e.g. 4GiB; 'auto' takes 25%% of "
                          "(total memory - model weights), total memory being physical memory "
                          "or the cgroup limit if lower, at most 8 GiB, and no more than "
                          "--max_num_seqs requests of --max_model_len tokens can use. The same "
                          "machine and model always get the same size."})
    max_gpu_memory_utilization: float = field(
        default=0.85,
        metadata={"help": "GPU: fraction of GPU memory for weights, activations and KV cache."})
    num_kv_blocks: int | None = field(
        default=None,
        metadata={"help": "Override the number of KV blocks (testing / capacity planning)."})
    disable_prompt_cache: bool = field(
        default=False, metadata={"help": "Turn off the prompt (prefix) cache."})
    kv_cache_quant: str = field(
        default="no_quant",
        metadata={"help": "KV-cache quantization; only no_quant is supported so far."})

    def __post_init__(self) -> None:
        _check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size",
               f"must be a power of two in [1, 128], got {self.block_size}")
        _check(0.0 < self.max_gpu_memory_utilization <= 1.0, "max_gpu_memory_utilization",
               f"must be in (0, 1], got {self.max_gpu_memory_utilization}")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 2, "num_kv_blocks",
               f"must be >= 2, got {self.num_kv_blocks}")
        if self.kv_cache_memory != "auto":
            try:
                size = parse_size(self.kv_cache_memory)
            except ValueError:
                raise ValueError(f"--kv_cache_memory: cannot parse {self.kv_cache_memory!r}")
            _check(size > 0, "kv_cache_memory", "must be positive")
        _check(self.kv_cache_quant == "no_quant", "kv_cache_quant",
               f"{self.kv_cache_quant!r} is not supported yet (only no_quant)")

    @property
    def enable_prompt_cache(self) -> bool:
        return not self.disable_prompt_cache


@dataclass
class SchedulerConfig:
    max_num_seqs: int = field(
        default=256, metadata={"help": "Most requests running in one step."})
    max_num_batched_tokens: int = field(
        default=2048,
        metadata={"help": "Token budget of one step; prompts longer than this are prefilled "
                          "in chunks mixed with decodes."})
    preempt_strategy: str = field(
        default="recompute",
        metadata={"help": "What to do when KV blocks run out: recompute (free the newest "
                          "request's blocks and recompute it later)."})
    max_queue_size: int | None = field(
        default=None,
        metadata={"help": "Most waiting requests; beyond it new requests get 503."})
    max_queue_time: float | None = field(
        default=None,
        metadata={"help": "Seconds a request may wait before it starts; past it, 503."})

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
               f"must be >= 1, got {self.max_num_batched_tokens}")
        _check(self.preempt_strategy == "recompute", "preempt_strategy",
               f"only 'recompute' is supported, got {self.preempt_strategy!r}")
        _check(self.max_queue_size is None or self.max_queue_size >= 1, "max_queue_size",
               f"must be >= 1, got {self.max_queue_size}")
        _check(self.max_queue_time is None or self.max_queue_time > 0, "max_queue_time",
               f"must be positive, got {self.max_queue_time}")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = field(
        default=1, metadata={"help": "Tensor-parallel degree (only 1 so far)."})
    pipeline_parallel_size: int = field(
        default=1, metadata={"help": "Pipeline-parallel degree (only 1 so far)."})
    num_threads: int | None = field(
        default=None,
        metadata={"help": "CPU: torch threads for the engine core; default OMP_NUM_THREADS "
                          "if set, else one per usable CPU (the CPU affinity set, cut to a "
                          "cgroup CPU quota). The server's engine-core process starts with "
                          "OMP_WAIT_POLICY=PASSIVE (unless OMP_WAIT_POLICY or GOMP_SPINCOUNT "
                          "is set) so idle threads sleep instead of spinning and a shared "
                          "machine slows decode down instead of stalling it; the API process "
                          "uses 1 thread. Offline LLM: set OMP_WAIT_POLICY before starting "
                          "Python (see docs/cpu.md)."})

    def __post_init__(self) -> None:
        _check(self.tensor_parallel_size == 1, "tensor_parallel_size",
               "tensor parallelism is not supported yet; use 1")
        _check(self.pipeline_parallel_size == 1, "pipeline_parallel_size",
               "pipeline parallelism is not supported yet; use 1")
        _check(self.num_threads is None or self.num_threads >= 1, "num_threads",
               f"must be >= 1, got {self.num_threads}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class EngineConfig:
    """Everything the engine core needs; the server adds ``ServerConfig``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: str = field(default="cpu", metadata={"help": "Device to run on (only cpu so far)."})
    debug_block_accounting: bool = field(
        default=False,
        metadata={"help": "Check after every step that no KV block is lost or double-freed "
                          "(slow; for debugging)."})

    def __post_init__(self) -> None:
        _check(self.device == "cpu", "device",
               f"only cpu is supported so far, got {self.device!r}")
        # A GPU-only knob must not be silently ignored on CPU.
        default_util = CacheConfig.__dataclass_fields__["max_gpu_memory_utilization"].default
        _check(self.cache.max_gpu_memory_utilization == default_util,
               "max_gpu_memory_utilization",
               "applies to GPU devices; on CPU size the KV cache with --kv_cache_memory")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from flat keyword arguments (``LLM(model=..., block_size=...)``)."""
        parts: dict[str, dict[str, Any]] = {}
        sections = {"model": ModelConfig, "cache": CacheConfig,
                    "scheduler": SchedulerConfig, "parallel": ParallelConfig}
        top: dict[str, Any] = {}
        for key, value in kwargs.items():
            for sec, klass in sections.items():
                if key in {f.name for f in dataclasses.fields(klass)}:
                    parts.setdefault(sec, {})[key] = value
                    break
            else:
                if key in ("device", "debug_block_accounting"):
                    top[key] = value
                else:
                    raise ValueError(f"unknown engine option {key!r}")
        return cls(**{sec: klass(**parts.get(sec, {})) for sec, klass in sections.items()},
                   **top)
