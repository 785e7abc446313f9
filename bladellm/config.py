"""Validated configuration: one dataclass per concern.

Every field carries ``metadata={"help": ...}``; the CLI (``bladellm.entrypoints.cli.args``) is
generated from these dataclasses, so a new flag is a new documented field here. A bad value raises
``ValueError`` naming the flag (``--max_num_seqs``), never a bare assert.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_SPEC_POLICIES = ("cost", "always")
SCHEDULING_POLICIES = ("fcfs", "priority")
# --spec_step_overhead default: a decode step's fixed cost in extra-token units, measured on the
# demo model (SmolLM2-135M, fp32) on a 2-vCPU AVX2 AMD EPYC (docs/speculative.md, "Cost rule").
SPEC_STEP_OVERHEAD = 14.0
# bladellm.quantization.QUANTIZATION_CHOICES (config.py imports nothing of the engine)
_QUANTIZATION = ("auto", "gptq", "awq", "compressed-tensors")


def _flag(name: str) -> str:
    return f"--{name}"


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{_flag(name)}: {msg}")


def parse_size(value: int | str) -> int:
    """Parse a byte size such as ``4GiB``, ``512MB``, ``1073741824``.

    ValueError for anything that is not a finite number of bytes (``inf``, ``nan``, ``1e999``
    included: ``int(float("inf"))`` would be an OverflowError)."""
    if isinstance(value, int):
        return value
    text = str(value).strip().lower().replace("ib", "").replace("b", "")
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    scale = 1
    if text and text[-1] in units:
        text, scale = text[:-1], units[text[-1]]
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"not a finite size: {value!r}")
    return int(number * scale)


def parse_size_flag(value: int | str, flag: str) -> int:
    """``parse_size`` for a flag: a positive size, else a ValueError naming ``--flag``."""
    try:
        size = parse_size(value)
    except ValueError:
        raise ValueError(f"--{flag}: cannot parse {value!r}") from None
    _check(size > 0, flag, "must be positive")
    return size


def _non_default(obj: Any, names: tuple[str, ...] | None = None) -> list[str]:
    """The fields of dataclass ``obj`` (or those of ``names``) whose value is not the default."""
    out = []
    for f in dataclasses.fields(obj):
        if names is not None and f.name not in names:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING \
            else f.default
        value = getattr(obj, f.name)
        if default is None and isinstance(value, (list, tuple)) and not value:
            continue  # an empty list of a None-default list flag gives nothing either
        if value != default:
            out.append(f.name)
    return out


ATTN_BACKENDS = ("auto", "paged", "torch", "triton")
# The product's documented name for its ragged paged-attention backend; ours is the paged
# attention of the kernel set chosen per device (``auto``: Triton on CUDA, compiled on a CPU).
ATTN_ALIASES = {"ragged_flash": "auto"}

logger = logging.getLogger(__name__)


def _attn_alias(flag: str, value: str) -> str:
    """``value`` with the product's backend names mapped to ours (and said so)."""
    ours = ATTN_ALIASES.get(value)
    if ours is None:
        return value
    logger.info("--%s %s: served by this engine's paged attention (--%s %s: Triton kernels on "
                "CUDA, the compiled CPU kernels on a CPU)", flag, value, flag, ours)
    return ours
# bladellm.kernels.KERNEL_SETS (config.py imports nothing of the engine)
KERNEL_SETS = ("auto", "compiled", "ref", "triton")


def _check_attn_kernels(attn_flag: str, attn_cls: str, kernels: str) -> None:
    """The Triton attention backend runs only on the Triton kernel set."""
    if attn_cls == "triton" and kernels in ("compiled", "ref"):
        raise ValueError(f"--{attn_flag} triton cannot run on --kernels {kernels}: the Triton "
                         f"attention kernels need the Triton kernel set; pass --kernels triton "
                         f"(or auto), or another --{attn_flag}")


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
                          "On a CPU, auto serves every checkpoint in bfloat16 where the CPU "
                          "has native bf16 (AVX512_BF16 or AMX), as vLLM does, and in float32 "
                          "on others, where bf16 is emulated (docs/cpu.md); on a GPU it keeps "
                          "the checkpoint's dtype. An explicit value always wins."})
    max_model_len: int | None = field(
        default=None,
        metadata={"help": "Longest prompt + output in tokens; defaults to the model's "
                          "max_position_embeddings."})
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow model code from the model directory."})
    served_model_name: str | None = field(
        default=None, metadata={"help": "Model name in the API; defaults to the directory name."})
    seed: int = field(
        default=0,
        metadata={"help": "The engine's random seed: sampling of requests that carry no seed "
                          "of their own is reproducible for a given --seed (and it seeds "
                          "--load_format dummy weights)."})
    enforce_eager: bool = field(
        default=False,
        metadata={"help": "Run every decoder layer through its PyTorch module on every step. "
                          "By default, steps of a few tokens (decodes) of Llama layout models "
                          "on the compiled CPU kernels run the whole decoder stack as one "
                          "compiled call: the CPU's counterpart of CUDA graph capture, with "
                          "bit identical results and without the Python of every layer. On a "
                          "GPU it also turns CUDA graphs off (as vLLM's --enforce-eager)."})
    disable_cuda_graph: bool = field(
        default=False,
        metadata={"help": "GPU (--device cuda): run every step eagerly instead of replaying "
                          "the CUDA graphs captured at start-up for decode steps "
                          "(docs/gpu.md, CUDA graphs). --enforce_eager disables them too."})
    cuda_graph_max_batch_size: int | None = field(
        default=None,
        metadata={"help": "GPU (--device cuda): largest decode batch (requests) given a CUDA "
                          "graph; larger steps run eagerly. Default: --max_num_seqs, at most "
                          "512. Refused on a CPU."})
    cuda_graph_batch_sizes: list[int] | None = field(
        default=None,
        metadata={"help": "GPU (--device cuda): the decode batch sizes (requests) to capture, "
                          "e.g. 1 2 4 8 16 32 64; a step is padded to the nearest size at or "
                          "above its own. Default: 1 2 4 8 16 24 ... 256, then steps of 16, "
                          "up to --cuda_graph_max_batch_size (which is added when not in the "
                          "list). Refused on a CPU."})
    kernels: str = field(
        default="auto",
        metadata={"help": "Kernel set every layer runs on, chosen once per worker with its "
                          "device: auto (on a CPU the kernels compiled for its ISA, or the "
                          "PyTorch reference if they cannot be built; on CUDA, or with "
                          "--attn_cls triton, the Triton kernels), compiled (the compiled CPU "
                          "kernels; an error if they cannot be built), ref (the PyTorch "
                          "reference twins; nothing is compiled) or triton (CUDA; on a CPU "
                          "only under TRITON_INTERPRET=1). See docs/kernels.md."})
    attn_cls: str = field(
        default="auto",
        metadata={"help": "Attention backend: auto / paged (the paged-attention kernels of "
                          "--kernels), torch (the PyTorch reference twins, whatever "
                          "--kernels) or triton (the Triton kernels; needs --kernels triton "
                          "or auto). ragged_flash (the product's name) means auto."})
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
    quantization: str = field(
        default="auto",
        metadata={"help": "Quantized checkpoint format: auto (read config.json's "
                          "quantization_config; a float checkpoint stays float), gptq, awq or "
                          "compressed-tensors (an error unless the checkpoint is in that "
                          "format). See docs/quantization.md."})

    def __post_init__(self) -> None:
        _check(bool(self.model), "model", "must not be empty")
        # '' would serve under the default name while /metrics labels it ''.
        _check(self.served_model_name is None or bool(self.served_model_name.strip()),
               "served_model_name", f"must not be empty, got {self.served_model_name!r}")
        _check(self.dtype in _DTYPES, "dtype", f"must be one of {_DTYPES}, got {self.dtype!r}")
        _check(self.max_model_len is None or self.max_model_len > 0, "max_model_len",
               f"must be positive, got {self.max_model_len}")
        _check(self.kernels in KERNEL_SETS, "kernels",
               f"must be one of {', '.join(KERNEL_SETS)}, got {self.kernels!r}")
        self.attn_cls = _attn_alias("attn_cls", self.attn_cls)
        _check(self.attn_cls in ATTN_BACKENDS, "attn_cls",
               f"unknown attention backend {self.attn_cls!r}; supported: "
               f"{', '.join(ATTN_BACKENDS)}")
        _check_attn_kernels("attn_cls", self.attn_cls, self.kernels)
        _check(self.model_hub in ("huggingface", "modelscope"), "model_hub",
               f"must be huggingface or modelscope, got {self.model_hub!r}")
        _check(self.load_format in ("auto", "safetensors", "pt", "gguf", "dummy"), "load_format",
               f"unknown format {self.load_format!r}")
        _check(self.quantization in _QUANTIZATION, "quantization",
               f"must be one of {', '.join(_QUANTIZATION)}, got {self.quantization!r}")
        _check(self.cuda_graph_max_batch_size is None or self.cuda_graph_max_batch_size > 0,
               "cuda_graph_max_batch_size",
               f"must be positive, got {self.cuda_graph_max_batch_size}")
        sizes = self.cuda_graph_batch_sizes
        if sizes is not None:
            _check(len(sizes) > 0 and all(s > 0 for s in sizes), "cuda_graph_batch_sizes",
                   f"must be positive batch sizes, got {sizes}")
            _check(len(set(sizes)) == len(sizes), "cuda_graph_batch_sizes",
                   f"lists a size twice: {sizes}")
            cap = self.cuda_graph_max_batch_size
            _check(cap is None or max(sizes) <= cap, "cuda_graph_batch_sizes",
                   f"{max(sizes)} is above --cuda_graph_max_batch_size {cap}")
        _check(not (self.disable_cuda_graph and self.sets_cuda_graph_sizes),
               "disable_cuda_graph", "cannot be combined with --cuda_graph_batch_sizes or "
               "--cuda_graph_max_batch_size (they would be ignored)")

    @property
    def sets_cuda_graph_sizes(self) -> bool:
        """--cuda_graph_batch_sizes or --cuda_graph_max_batch_size given: GPU-only knobs that
        must not be accepted and ignored where no graph is captured."""
        return self.cuda_graph_batch_sizes is not None \
            or self.cuda_graph_max_batch_size is not None

    @property
    def cuda_graph_size_flag(self) -> str:
        """The graph size flag given (for error messages)."""
        return ("cuda_graph_batch_sizes" if self.cuda_graph_batch_sizes is not None
                else "cuda_graph_max_batch_size")


KV_CACHE_QUANTS = ("no_quant", "int8")
DEVICES = ("auto", "cpu", "cuda")  # bladellm.platforms.select keeps the same tuple


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
                          "machine and model always get the same size. On a GPU, auto sizes "
                          "the cache by a profiling forward (--max_gpu_memory_utilization) "
                          "and an explicit SIZE overrides it."})
    max_gpu_memory_utilization: float = field(
        default=0.90,
        metadata={"help": "GPU (--device cuda): fraction of the GPU's memory this engine may "
                          "use for weights, activations and the KV cache. After loading the "
                          "weights a profiling forward at the largest step the scheduler can "
                          "build measures the activations' peak; the KV cache gets "
                          "utilization x total - weights - that peak (docs/gpu.md). With "
                          "--num_kv_blocks or --kv_cache_memory, those set the size instead."})
    num_kv_blocks: int | None = field(
        default=None,
        metadata={"help": "Override the number of KV blocks (testing / capacity planning)."})
    disable_prompt_cache: bool = field(
        default=False, metadata={"help": "Turn off the prompt (prefix) cache."})
    kv_cache_quant: str = field(
        default="no_quant",
        metadata={"help": "KV-cache storage: no_quant (the model dtype) or int8 (each token's "
                          "K and V row per KV head quantized with its own absmax scale; about "
                          "half the bytes of bf16, a quarter of fp32, so the same "
                          "--kv_cache_memory holds ~2x / ~3.8x the tokens). See "
                          "docs/kv_cache_quant.md."})
    disable_hybrid_kv_cache: bool = field(
        default=False,
        metadata={"help": "Models that mix sliding-window and global layers (Gemma 2/3, Qwen2 "
                          "with max_window_layers): keep every KV block for every layer (one "
                          "block table) instead of one KV cache group per kind of layer, "
                          "whose window groups free the blocks that left the window. See "
                          "docs/models.md."})

    def __post_init__(self) -> None:
        _check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size",
               f"must be a power of two in [1, 128], got {self.block_size}")
        _check(0.0 < self.max_gpu_memory_utilization <= 1.0, "max_gpu_memory_utilization",
               f"must be in (0, 1], got {self.max_gpu_memory_utilization}")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 2, "num_kv_blocks",
               f"must be >= 2, got {self.num_kv_blocks}")
        if self.kv_cache_memory != "auto":
            parse_size_flag(self.kv_cache_memory, "kv_cache_memory")
            # --num_kv_blocks wins (platforms/cpu_defaults.py): the size would be ignored.
            _check(self.num_kv_blocks is None, "kv_cache_memory",
                   "cannot be combined with --num_kv_blocks (which sets the KV cache size "
                   "itself); give one of them")
        _check(self.kv_cache_quant in KV_CACHE_QUANTS, "kv_cache_quant",
               f"must be one of {', '.join(KV_CACHE_QUANTS)}, got {self.kv_cache_quant!r}")

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
    max_num_encoder_tokens_per_step: int | None = field(
        default=None,
        metadata={"help": "Most image tokens whose vision encoding may start in one step (a "
                          "vision-language model; default: no limit): a prefill chunk stops "
                          "before an image that would exceed it (docs/multimodal.md)."})
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
    scheduling_policy: str = field(
        default="fcfs",
        metadata={"help": "fcfs (first come, first served) or priority: waiting requests are "
                          "admitted by their request's priority (lower first, as in vLLM), then "
                          "arrival, and a waiting request may preempt running ones of lower "
                          "priority when KV blocks or sequence slots run out. Under fcfs a "
                          "request with a priority other than 0 is refused (400 naming "
                          "priority). See docs/server.md, Priority scheduling.",
                  "choices": SCHEDULING_POLICIES})
    priority_aging_interval: float = field(
        default=60.0,
        metadata={"help": "--scheduling_policy priority: seconds of waiting that improve a "
                          "request's effective priority by one level, so that a request is "
                          "never passed by one of priority q that arrived more than "
                          "(its priority - q) x this many seconds after it (the starvation "
                          "bound). A huge value gives strict priority (vLLM's rule)."})
    async_scheduling: bool = field(
        default=False,
        metadata={"help": "Schedule and prepare step n + 1 while step n runs: a decode row "
                          "takes its input token from step n's sampled ids on the device, and "
                          "stop checks apply when those ids reach the host, one step late "
                          "(docs/scheduler.md). Requests with a grammar or repetition/"
                          "presence/frequency penalties wait for their last token instead. "
                          "Not with --decode_algo sps/look_ahead or a world size > 1."})

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
               f"must be >= 1, got {self.max_num_batched_tokens}")
        _check(self.max_num_encoder_tokens_per_step is None
               or self.max_num_encoder_tokens_per_step >= 1, "max_num_encoder_tokens_per_step",
               f"must be >= 1, got {self.max_num_encoder_tokens_per_step}")
        _check(self.preempt_strategy == "recompute", "preempt_strategy",
               f"only 'recompute' is supported, got {self.preempt_strategy!r}")
        _check(self.max_queue_size is None or self.max_queue_size >= 1, "max_queue_size",
               f"must be >= 1, got {self.max_queue_size}")
        _check(self.max_queue_time is None or self.max_queue_time > 0, "max_queue_time",
               f"must be positive, got {self.max_queue_time}")
        _check(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy",
               f"must be one of {list(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}")
        _check(math.isfinite(self.priority_aging_interval) and self.priority_aging_interval > 0,
               "priority_aging_interval",
               f"must be a finite number of seconds > 0, got {self.priority_aging_interval}")
        # A knob nothing reads must not be silently accepted.
        _check(self.scheduling_policy == "priority"
               or "priority_aging_interval" not in _non_default(self), "priority_aging_interval",
               "only used with --scheduling_policy priority")

    @property
    def priority_scheduling(self) -> bool:
        return self.scheduling_policy == "priority"


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = field(
        default=1, metadata={"help": "Tensor-parallel degree: that many worker processes, "
                                     "each holding a shard of every layer (any degree: shards "
                                     "may be uneven, see docs/parallel.md); torch.distributed "
                                     "with gloo on CPU."})
    pipeline_parallel_size: int = field(
        default=1, metadata={"help": "Pipeline-parallel degree: the decoder layers are split "
                                     "into that many stages (lengths differ by at most one), "
                                     "each run by --tensor_parallel_size processes; up to "
                                     "that many micro-batches are in flight (docs/parallel.md)."})
    enable_expert_parallel: bool = field(
        default=False,
        metadata={"help": "Mixture-of-experts models: split the experts over the "
                          "tensor-parallel ranks (whole experts per rank; each token's hidden "
                          "state goes to the ranks of its experts and back with all-to-all) "
                          "instead of splitting every expert's intermediate size; attention "
                          "stays tensor parallel. Needs --tensor_parallel_size > 1 and a "
                          "mixture-of-experts model (docs/models.md)."})
    distributed_init_method: str | None = field(
        default=None,
        metadata={"help": "torch.distributed rendezvous of the worker ranks (e.g. "
                          "tcp://HOST:PORT); default a free local port. World size > 1 only."})
    nnodes: int = field(
        default=1,
        metadata={"help": "Machines the worker ranks run on: this one (node 0, the engine) runs "
                          "ranks 0..L-1 (L = world size / nnodes), each other node k runs ranks "
                          "k*L..k*L+L-1 under blade_llm_worker (e.g. launched by torchrun); "
                          "needs --master_addr, --master_port, --cluster_key_file. See "
                          "docs/parallel.md, Multi-node."})
    node_rank: int = field(
        default=0,
        metadata={"help": "This machine's node index, 0..nnodes-1: 0 for blade_llm_server / "
                          "LLM (the engine), 1.. for blade_llm_worker."})
    master_addr: str | None = field(
        default=None,
        metadata={"help": "--nnodes > 1: the engine machine's address every node reaches. "
                          "torch.distributed rendezvous at MASTER_ADDR:MASTER_PORT; the engine "
                          "also listens on MASTER_PORT+1 (steps) and MASTER_PORT+2 (answers, "
                          "heartbeats)."})
    master_port: int | None = field(
        default=None,
        metadata={"help": "--nnodes > 1: first of the three TCP ports on --master_addr (see "
                          "there); must differ from torchrun's own --master-port."})
    cluster_key_file: str | None = field(
        default=None,
        metadata={"help": "--nnodes > 1: file holding the secret shared by all nodes (at least "
                          "16 bytes, not readable by other users; e.g. openssl rand -hex 32). "
                          "Every step and answer between the engine and the nodes is "
                          "authenticated with it (HMAC-SHA256, checked before unpickling) and "
                          "encrypted (ZMQ CURVE); torch.distributed's own traffic (rendezvous, "
                          "gloo collectives) is not: run the nodes on a private network."})
    num_threads: int | None = field(
        default=None,
        metadata={"help": "CPU: torch threads for the engine core; default OMP_NUM_THREADS "
                          "if set, else one per usable CPU (the CPU affinity set, cut to a "
                          "cgroup CPU quota). The engine-core process starts with "
                          "GOMP_SPINCOUNT=1000 (unless OMP_WAIT_POLICY, GOMP_SPINCOUNT or "
                          "KMP_BLOCKTIME is set): threads spin briefly between a step's "
                          "kernels and sleep between steps, so a shared machine slows decode "
                          "down instead of stalling it; OMP_WAIT_POLICY=PASSIVE suits a "
                          "machine shared with CPU-bound work. The API process uses 1 thread. "
                          "Offline LLM: the engine sets it when it starts, before torch loads "
                          "(see docs/cpu.md)."})

    def __post_init__(self) -> None:
        _check(self.tensor_parallel_size >= 1, "tensor_parallel_size",
               f"must be >= 1, got {self.tensor_parallel_size}")
        _check(self.pipeline_parallel_size >= 1, "pipeline_parallel_size",
               f"must be >= 1, got {self.pipeline_parallel_size}")
        _check(self.distributed_init_method is None or (
            self.distributed_init_method.startswith(("tcp://", "env://", "file://"))),
            "distributed_init_method",
            f"must be a torch.distributed URL (tcp://, env://, file://), got "
            f"{self.distributed_init_method!r}")
        _check(self.distributed_init_method is None or self.world_size > 1,
               "distributed_init_method", "only used with --tensor_parallel_size or "
               "--pipeline_parallel_size > 1")
        _check(not self.enable_expert_parallel or self.tensor_parallel_size > 1,
               "enable_expert_parallel", "needs --tensor_parallel_size > 1: the experts are "
               "split over the tensor-parallel ranks")
        _check(self.num_threads is None or self.num_threads >= 1, "num_threads",
               f"must be >= 1, got {self.num_threads}")
        self._check_nodes()

    def _check_nodes(self) -> None:
        _check(self.nnodes >= 1, "nnodes", f"must be >= 1, got {self.nnodes}")
        _check(0 <= self.node_rank < self.nnodes, "node_rank",
               f"must be in 0..{self.nnodes - 1} (--nnodes {self.nnodes}), got {self.node_rank}")
        if self.nnodes == 1:
            for name in ("master_addr", "master_port", "cluster_key_file"):
                _check(getattr(self, name) is None, name, "only used with --nnodes > 1")
            return
        _check(self.world_size % self.nnodes == 0, "nnodes",
               f"must divide the world size (--tensor_parallel_size x --pipeline_parallel_size "
               f"= {self.world_size}) so every node runs as many ranks, got {self.nnodes}")
        _check(bool(self.master_addr), "master_addr", "required with --nnodes > 1")
        _check(self.master_port is not None and 1 <= self.master_port <= 65533, "master_port",
               f"required with --nnodes > 1, in 1..65533 (it and the next two ports are used), "
               f"got {self.master_port}")
        _check(bool(self.cluster_key_file), "cluster_key_file", "required with --nnodes > 1")
        _check(self.distributed_init_method is None, "distributed_init_method",
               "not used with --nnodes > 1: the rendezvous is tcp://MASTER_ADDR:MASTER_PORT")

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def driver_rank(self) -> int:
        """The rank that samples and answers: TP rank 0 of the last pipeline stage."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size


_DECODE_ALGOS = ("normal", "sps", "look_ahead")


@dataclass
class DraftConfig:
    """The draft model of ``--decode_algo sps`` (flags ``--draft.model``, ``--draft.attn_cls``)."""

    cli_prefix = "draft."

    model: str | None = field(
        default=None,
        metadata={"help": "Draft model directory for --decode_algo sps: any architecture the "
                          "engine loads, with the target's vocabulary (a shallower model "
                          "sharing the tokenizer). 'demo' is the built-in SmolLM2 135M."})
    attn_cls: str = field(
        default="auto",
        metadata={"help": "Attention backend of the draft model: auto, paged, torch or triton "
                          "(see --attn_cls; ragged_flash means auto)."})
    dtype: str = field(
        default="auto", metadata={"help": "Draft model dtype (see --dtype); auto: the "
                                          "target's resolved dtype."})

    def __post_init__(self) -> None:
        _check(self.model is None or bool(self.model), "draft.model", "must not be empty")
        self.attn_cls = _attn_alias("draft.attn_cls", self.attn_cls)
        _check(self.attn_cls in ATTN_BACKENDS, "draft.attn_cls",
               f"unknown attention backend {self.attn_cls!r}; supported: "
               f"{', '.join(ATTN_BACKENDS)}")
        _check(self.dtype in _DTYPES, "draft.dtype",
               f"must be one of {_DTYPES}, got {self.dtype!r}")


# SpeculativeConfig fields that only one --decode_algo reads (spec_decode/draft_model.py,
# spec_decode/lookahead.py, core/scheduler.py).
_SPEC_ALGO_FIELDS = {"gamma": "sps", "look_ahead_window_size": "look_ahead",
                     "look_ahead_gram_size": "look_ahead", "guess_set_size": "look_ahead"}


@dataclass
class SpeculativeConfig:
    """Speculative decoding (draft model) and lookahead decoding; see docs/speculative.md."""

    decode_algo: str = field(
        default="normal",
        metadata={"help": "normal (one token per step), sps (speculative sampling with "
                          "--draft.model proposing --gamma tokens) or look_ahead (Jacobi "
                          "lookahead window and a pool of guessed token sequences seeded from "
                          "the prompt, verified in the same forward pass). Outputs equal normal "
                          "decoding: greedy token for token, sampling in distribution.",
                  "choices": _DECODE_ALGOS})
    gamma: int = field(
        default=4, metadata={"help": "sps: tokens the draft proposes per step (1..16)."})
    look_ahead_window_size: int = field(
        default=4, metadata={"help": "look_ahead: Jacobi window width W (1..16)."})
    look_ahead_gram_size: int = field(
        default=4, metadata={"help": "look_ahead: gram size N (2..8), the length of the "
                                     "Jacobi trajectories collected; a guess holds N minus 1 "
                                     "tokens."})
    guess_set_size: int = field(
        default=4, metadata={"help": "look_ahead: most n-grams verified per step G (1..16)."})
    spec_policy: str = field(
        default="cost",
        metadata={"help": "sps / look_ahead: cost (grant proposals, and run the sps draft, "
                          "only where the expected accepted tokens pay for the extra query "
                          "tokens, LM-head rows and draft forwards in the step: see "
                          "docs/speculative.md) or always (every request speculates every step "
                          "within the token budget, e.g. to test the verification path).",
                  "choices": _SPEC_POLICIES})
    spec_step_overhead: float = field(
        default=SPEC_STEP_OVERHEAD,
        metadata={"help": "sps / look_ahead with --spec_policy cost: a step's fixed cost in "
                          "units of one extra query token with its LM-head row (step cost = "
                          "overhead + tokens). Default measured on the demo model on a 2-vCPU "
                          "AVX2 CPU; a GPU's is far larger (extra tokens are nearly free). "
                          "0 < value <= 100000."})

    def __post_init__(self) -> None:
        _check(self.decode_algo in _DECODE_ALGOS, "decode_algo",
               f"unknown algorithm {self.decode_algo!r}; supported: {', '.join(_DECODE_ALGOS)}")
        _check(1 <= self.gamma <= 16, "gamma", f"must be in 1..16, got {self.gamma}")
        _check(1 <= self.look_ahead_window_size <= 16, "look_ahead_window_size",
               f"must be in 1..16, got {self.look_ahead_window_size}")
        _check(2 <= self.look_ahead_gram_size <= 8, "look_ahead_gram_size",
               f"must be in 2..8, got {self.look_ahead_gram_size}")
        _check(1 <= self.guess_set_size <= 16, "guess_set_size",
               f"must be in 1..16, got {self.guess_set_size}")
        _check(self.spec_policy in _SPEC_POLICIES, "spec_policy",
               f"unknown policy {self.spec_policy!r}; supported: {', '.join(_SPEC_POLICIES)}")
        _check(isinstance(self.spec_step_overhead, (int, float))
               and 0 < self.spec_step_overhead <= 100000, "spec_step_overhead",
               f"must be a number in (0, 100000], got {self.spec_step_overhead!r}")
        # The cost knobs steer speculation only: given without it (or with the cost rule off)
        # they would be silently ignored.
        if self.spec_policy != "cost" or not self.enabled:
            _check(self.spec_step_overhead == SPEC_STEP_OVERHEAD, "spec_step_overhead",
                   "only used with --decode_algo sps / look_ahead and --spec_policy cost")
        if not self.enabled:
            _check(self.spec_policy == "cost", "spec_policy",
                   "only used with --decode_algo sps / look_ahead")
        # Each algorithm's own knobs: given with another one they would be silently ignored.
        for name in _non_default(self, _SPEC_ALGO_FIELDS):
            algo = _SPEC_ALGO_FIELDS[name]
            _check(self.decode_algo == algo, name,
                   f"only used with --decode_algo {algo} (got --decode_algo {self.decode_algo})")

    @property
    def enabled(self) -> bool:
        return self.decode_algo != "normal"

    @property
    def max_spec_tokens(self) -> int:
        """Most proposed tokens one request carries in a step."""
        if self.decode_algo == "sps":
            return self.gamma
        if self.decode_algo == "look_ahead":
            return self.look_ahead_gram_size - 1
        return 0


@dataclass
class GuidedDecodingConfig:
    """Structured output (JSON schema / regex / choice / grammar); docs/structured_output.md."""

    guided_decoding_backend: str = field(
        default="llguidance",
        metadata={"help": "Grammar engine for guided decoding and JSON mode: llguidance."})
    guided_cache_size: int = field(
        default=256,
        metadata={"help": "Compiled grammars kept in an LRU cache keyed by the normalised "
                          "constraint (0 disables the cache)."})
    guided_compile_timeout: float = field(
        default=10.0,
        metadata={"help": "Seconds a request waits for its grammar to compile before it fails."})
    guided_max_grammar_size: int = field(
        default=500_000,
        metadata={"help": "Largest grammar (llguidance symbols) a constraint may compile to; "
                          "larger ones get HTTP 400."})
    enable_json_warmup: bool = field(
        default=False,
        metadata={"help": "At start-up build the grammar engine's tokenizer bridge and "
                          "compile the JSON-object grammar and --json_warmup_schemas, so the "
                          "first JSON-mode requests compile nothing."})
    json_warmup_schemas: list[str] | None = field(
        default=None,
        metadata={"help": "JSON-schema files to precompile with --enable_json_warmup."})

    def __post_init__(self) -> None:
        _check(self.guided_decoding_backend == "llguidance", "guided_decoding_backend",
               f"only 'llguidance' is supported, got {self.guided_decoding_backend!r}")
        _check(self.guided_cache_size >= 0, "guided_cache_size",
               f"must be >= 0, got {self.guided_cache_size}")
        _check(self.guided_compile_timeout > 0, "guided_compile_timeout",
               f"must be positive, got {self.guided_compile_timeout}")
        _check(self.guided_max_grammar_size >= 1000, "guided_max_grammar_size",
               f"must be >= 1000, got {self.guided_max_grammar_size}")
        _check(not self.json_warmup_schemas or self.enable_json_warmup, "json_warmup_schemas",
               "needs --enable_json_warmup")
        _check(not self.enable_json_warmup or self.guided_cache_size > 0, "enable_json_warmup",
               "needs --guided_cache_size > 0 (the warm-up fills that cache)")


_LORA_DTYPES = ("auto", "float16", "bfloat16", "float32")


@dataclass
class LoRAConfig:
    """Multi-LoRA serving (docs/lora.md)."""

    enable_lora: bool = field(
        default=False,
        metadata={"help": "Serve PEFT LoRA adapters on top of --model; a request picks one by "
                          "its `model` field (a registered name or a path under --lora_root)."})
    max_lora_rank: int = field(
        default=16, metadata={"help": "Largest adapter rank accepted (device slots are sized "
                                      "for it)."})
    max_loras: int = field(
        default=4, metadata={"help": "Adapters resident on the device, i.e. the most distinct "
                                     "adapters among running requests; others wait."})
    max_cpu_loras: int | None = field(
        default=None,
        metadata={"help": "Adapters kept in host memory (>= --max_loras; default: "
                          "--max_loras); the least recently used unused one is dropped."})
    lora_dtype: str = field(
        default="auto", metadata={"help": "dtype of adapter weights: auto (the model's), "
                                          "float16, bfloat16 or float32."})
    lora_modules: list[str] | None = field(
        default=None,
        metadata={"help": "Adapters registered at start-up, as name=path (vLLM style)."})
    max_lora_entries: int = field(
        default=256,
        metadata={"help": "Most adapters registered at run time (reached by path, or loaded "
                          "with /v1/load_lora_adapter) at once; past it the least recently "
                          "used unused adapter reached by path is forgotten."})
    lora_root: list[str] | None = field(
        default=None,
        metadata={"help": "The only directories from which adapters may be loaded by path "
                          "(requests, /v1/load_lora_adapter, --lora_modules); symlinks are "
                          "resolved before the check."})

    def __post_init__(self) -> None:
        if not self.enable_lora:
            # Every LoRA knob is read only by the LoRA path: without it it would be ignored.
            for name in _non_default(self):
                if name == "max_cpu_loras" and self.max_cpu_loras == self.max_loras:
                    continue  # its default, as filled in below (dataclasses.replace re-checks)
                _check(False, name, "only used with --enable_lora")
        _check(self.max_lora_rank >= 1, "max_lora_rank",
               f"must be >= 1, got {self.max_lora_rank}")
        _check(self.max_loras >= 1, "max_loras", f"must be >= 1, got {self.max_loras}")
        _check(self.max_lora_entries >= 1, "max_lora_entries",
               f"must be >= 1, got {self.max_lora_entries}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        _check(self.max_cpu_loras >= self.max_loras, "max_cpu_loras",
               f"must be >= --max_loras ({self.max_loras}), got {self.max_cpu_loras}")
        _check(self.lora_dtype in _LORA_DTYPES, "lora_dtype",
               f"must be one of {_LORA_DTYPES}, got {self.lora_dtype!r}")
        seen: set[str] = set()
        for item in self.lora_modules or []:
            name, sep, path = item.partition("=")
            _check(bool(sep and name.strip() and path.strip()), "lora_modules",
                   f"expected name=path, got {item!r}")
            # Last-wins would silently drop an adapter the operator asked for.
            _check(name not in seen, "lora_modules", f"the name {name!r} is given twice")
            seen.add(name)

    @property
    def named_modules(self) -> dict[str, str]:
        return dict(item.split("=", 1) for item in self.lora_modules or [])


# A finite default: an unbounded number of images per request would let one request hold the
# encoder (and the API process's image decoding) for as long as it likes.
DEFAULT_IMAGE_LIMIT = 8


def parse_mm_limits(value: str | None) -> dict[str, int]:
    """``--limit_mm_per_prompt``: ``image=N`` (comma-separated ``modality=N`` pairs) or vLLM's
    JSON ``{"image": N}``; only the image modality is served."""
    if value is None or not str(value).strip():
        return {"image": DEFAULT_IMAGE_LIMIT}
    text = str(value).strip()
    if text.startswith("{"):
        import json

        try:
            raw = json.loads(text)
        except ValueError:
            raise ValueError(f"--limit_mm_per_prompt: not valid JSON: {text!r}") from None
        _check(isinstance(raw, dict), "limit_mm_per_prompt", "JSON must be an object")
        pairs = list(raw.items())
    else:
        pairs = []
        for item in text.split(","):
            key, sep, num = item.partition("=")
            _check(bool(sep), "limit_mm_per_prompt", f"expected modality=N, got {item!r}")
            try:
                pairs.append((key.strip(), int(num)))
            except ValueError:
                raise ValueError(f"--limit_mm_per_prompt: {num!r} is not an integer") from None
    limits = {"image": DEFAULT_IMAGE_LIMIT}
    for key, num in pairs:
        _check(key == "image", "limit_mm_per_prompt",
               f"only the 'image' modality is supported, got {key!r}")
        _check(isinstance(num, int) and not isinstance(num, bool) and num >= 0,
               "limit_mm_per_prompt", f"image: must be an integer >= 0, got {num!r}")
        limits[key] = num
    return limits


@dataclass
class MultiModalConfig:
    """Images in prompts (docs/multimodal.md); read only for a vision-language model."""

    limit_mm_per_prompt: str | None = field(
        default=None,
        metadata={"help": f"Most images one request may carry, as image=N (or vLLM's JSON "
                          f"'{{\"image\": N}}'); default image={DEFAULT_IMAGE_LIMIT}."})
    max_image_pixels: int = field(
        default=4096 * 4096,
        metadata={"help": "Largest image accepted, in pixels (width x height, read from the "
                          "header before decoding); larger ones, decompression bombs "
                          "included, are a 400."})
    max_image_bytes: str = field(
        default="20MiB",
        metadata={"help": "Largest encoded image accepted (a data: URL after base64 "
                          "decoding, or a fetched URL's body)."})
    allowed_media_domains: list[str] | None = field(
        default=None,
        metadata={"help": "Hosts whose http(s) image URLs the server may fetch (exact host "
                          "names). Default: none; only data: URLs are accepted, so no request "
                          "can make the server fetch a URL."})
    media_fetch_timeout: float = field(
        default=10.0,
        metadata={"help": "Seconds allowed for fetching one image URL (with "
                          "--allowed_media_domains)."})

    def __post_init__(self) -> None:
        parse_mm_limits(self.limit_mm_per_prompt)
        _check(isinstance(self.max_image_pixels, int) and self.max_image_pixels > 0,
               "max_image_pixels", f"must be a positive integer, got {self.max_image_pixels!r}")
        parse_size_flag(self.max_image_bytes, "max_image_bytes")
        _check(math.isfinite(self.media_fetch_timeout) and self.media_fetch_timeout > 0,
               "media_fetch_timeout", f"must be positive, got {self.media_fetch_timeout}")
        for host in self.allowed_media_domains or []:
            _check(bool(host) and "/" not in host and ":" not in host and host == host.strip(),
                   "allowed_media_domains", f"expected a bare host name, got {host!r}")

    @property
    def image_limit(self) -> int:
        return parse_mm_limits(self.limit_mm_per_prompt)["image"]

    @property
    def max_image_nbytes(self) -> int:
        return parse_size_flag(self.max_image_bytes, "max_image_bytes")


@dataclass
class EngineConfig:
    """Everything the engine core needs; the server adds ``ServerConfig``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    guided: GuidedDecodingConfig = field(default_factory=GuidedDecodingConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    multimodal: MultiModalConfig = field(default_factory=MultiModalConfig)
    device: str = field(
        default="auto",
        metadata={"help": "Device to run on: auto (cuda when torch sees a GPU, else cpu), cpu "
                          "or cuda (one GPU per rank: rank i of a machine on cuda:i; "
                          "docs/gpu.md). Chosen once at start-up and logged.",
                  "choices": DEVICES})
    debug_block_accounting: bool = field(
        default=False,
        metadata={"help": "Check after every step that no KV block is lost or double-freed "
                          "(slow; for debugging)."})

    def __post_init__(self) -> None:
        _check(self.device in DEVICES, "device",
               f"must be one of {', '.join(DEVICES)}, got {self.device!r}")
        # A GPU-only knob must not be silently ignored on CPU (--device auto on a machine
        # without a GPU: the worker refuses it, platforms/select.py resolves auto).
        _check(self.device != "cpu" or not self.sets_gpu_memory_utilization,
               "max_gpu_memory_utilization",
               "applies to GPU devices; on CPU size the KV cache with --kv_cache_memory")
        # Likewise the CUDA graph sizes (--device auto resolving to a CPU: the runner refuses
        # them, worker/cuda_graphs.py).
        _check(self.device != "cpu" or not self.model.sets_cuda_graph_sizes,
               self.model.cuda_graph_size_flag, "CUDA graphs are captured on GPU devices only "
               "(--device cuda); drop --cuda_graph_batch_sizes / --cuda_graph_max_batch_size "
               "on --device cpu")
        self._check_cuda_graph_sizes()
        _check_attn_kernels("draft.attn_cls", self.draft.attn_cls, self.model.kernels)
        spec = self.speculative
        if spec.decode_algo == "sps":
            _check(self.draft.model is not None, "draft.model",
                   "--decode_algo sps needs a draft model directory")
        else:
            # A draft flag that nothing would use must not be silently ignored.
            for name in _non_default(self.draft):
                _check(False, DraftConfig.cli_prefix + name,
                       f"only used with --decode_algo sps (got --decode_algo {spec.decode_algo})")
        if self.parallel.world_size > 1:
            # Not built on the tensor-parallel path yet (docs/parallel.md): refused, not ignored.
            _check(not spec.enabled, "decode_algo",
                   f"--decode_algo {spec.decode_algo} is not supported with "
                   "--tensor_parallel_size or --pipeline_parallel_size > 1 yet")
        if self.scheduler.async_scheduling:
            # The next step's input token is gathered from the previous step's sampled ids on
            # the sampling rank; other ranks never hold them, and a verification step needs its
            # proposals (made from the accepted tokens) before it is scheduled.
            _check(self.parallel.world_size == 1, "async_scheduling",
                   "is not supported with --tensor_parallel_size or --pipeline_parallel_size "
                   "> 1 yet (pipeline parallelism already overlaps its micro-batches)")
            _check(not spec.enabled, "async_scheduling",
                   f"cannot be combined with --decode_algo {spec.decode_algo}: a verification "
                   "step needs the previous step's accepted tokens to propose from")
        # Adapters for layers of other stages would have to be split per stage (not built).
        _check(not (self.lora.enable_lora and self.parallel.pipeline_parallel_size > 1),
               "enable_lora", "cannot be combined with --pipeline_parallel_size > 1 yet")
        # The verification step and the sps draft have no LoRA path yet (docs/lora.md).
        _check(not (self.lora.enable_lora and spec.enabled), "enable_lora",
               f"cannot be combined with --decode_algo {spec.decode_algo} yet")
        # A `model` equal to the served name picks the base model: such an adapter is unreachable.
        _check(self.model.served_model_name is None
               or self.model.served_model_name not in self.lora.named_modules, "lora_modules",
               f"{self.model.served_model_name!r} is the base model's served name "
               "(--served_model_name); an adapter under it could never be selected")

    def _check_cuda_graph_sizes(self) -> None:
        """A listed size no step can reach would be captured and never replayed."""
        model, sched = self.model, self.scheduler
        if model.cuda_graph_batch_sizes is None:
            return
        reach = min(sched.max_num_seqs, sched.max_num_batched_tokens)
        _check(max(model.cuda_graph_batch_sizes) <= reach, "cuda_graph_batch_sizes",
               f"{max(model.cuda_graph_batch_sizes)} is above the largest decode batch "
               f"{reach} (--max_num_seqs {sched.max_num_seqs}, --max_num_batched_tokens "
               f"{sched.max_num_batched_tokens})")

    @property
    def sets_gpu_memory_utilization(self) -> bool:
        default = CacheConfig.__dataclass_fields__["max_gpu_memory_utilization"].default
        return self.cache.max_gpu_memory_utilization != default

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from flat keyword arguments (``LLM(model=..., block_size=...)``)."""
        parts: dict[str, dict[str, Any]] = {}
        sections = {"model": ModelConfig, "cache": CacheConfig,
                    "scheduler": SchedulerConfig, "parallel": ParallelConfig,
                    "guided": GuidedDecodingConfig, "speculative": SpeculativeConfig,
                    "draft": DraftConfig, "lora": LoRAConfig,
                    "multimodal": MultiModalConfig}
        top: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key.startswith("draft_"):  # LLM(draft_model=...) for --draft.model
                parts.setdefault("draft", {})[key[len("draft_"):]] = value
                continue
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
