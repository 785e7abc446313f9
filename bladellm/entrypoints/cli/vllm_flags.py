"""vLLM's command-line spellings, mapped onto our config by one table.

Most vLLM flags are already ours in dash spelling (``--max-model-len``, ``--served-model-name``,
``--tensor-parallel-size``, ``--api-key``, ``--chat-template``, ``--trust-remote-code``, ...);
``ALIASES`` adds the ones whose names differ, ``FIXED`` the ones that ask for what BladeLLM always
does (accepted, their opposite refused), and ``NOT_SUPPORTED_YET`` the rest of vLLM's serving
flags: they fail with "not supported yet" instead of argparse's "unrecognized arguments".
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Alias:
    flag: str  # vLLM's spelling
    dest: str  # our argparse dest: f"{section}__{field}"
    ours: str  # our flag, for --help
    const: Any = None  # set for switches: the value stored
    convert: Callable[[str], Any] | None = None  # for flags with a value


def _kv_cache_dtype(value: str) -> str:
    return "no_quant" if value == "auto" else value  # anything else: --kv_cache_quant refuses it


ALIASES: tuple[Alias, ...] = (
    Alias("--gpu-memory-utilization", "cache__max_gpu_memory_utilization",
          "--max_gpu_memory_utilization", convert=float),
    Alias("--enable-prefix-caching", "cache__disable_prompt_cache", "no --disable_prompt_cache",
          const=False),
    Alias("--no-enable-prefix-caching", "cache__disable_prompt_cache", "--disable_prompt_cache",
          const=True),
    Alias("--kv-cache-dtype", "cache__kv_cache_quant", "--kv_cache_quant (auto = no_quant)",
          convert=_kv_cache_dtype),
    Alias("--uvicorn-log-level", "server__log_level", "--log_level", convert=str),
    Alias("--disable-uvicorn-access-log", "server__disable_access_log", "--disable_access_log",
          const=True),
    Alias("-tp", "parallel__tensor_parallel_size", "--tensor_parallel_size", convert=int),
    Alias("-pp", "parallel__pipeline_parallel_size", "--pipeline_parallel_size", convert=int),
)

# Flags that request BladeLLM's fixed behaviour: accepted; the opposite spelling is refused.
FIXED: dict[str, str] = {
    "--enable-chunked-prefill": "long prompts are always prefilled in chunks",
    "--enforce-eager": "the CPU engine always runs eagerly (no graph capture)",
    "--disable-log-requests": "request contents are never logged",
    "--enable-auto-tool-choice": "tool calls are parsed whenever a request sends tools with "
                                 "tool_choice auto (Hermes / Llama 3 formats, auto-detected)",
    "--no-disable-log-requests": "request contents are never logged",
}
OPPOSITE_OF_FIXED: dict[str, str] = {
    "--no-enable-chunked-prefill": "chunked prefill cannot be turned off",
    "--no-enforce-eager": "there is no graph capture on CPU to turn on",
    "--enable-log-requests": "logging request contents is not supported",
}

# vLLM serving flags without a BladeLLM equivalent yet; True = the flag takes a value.
NOT_SUPPORTED_YET: dict[str, bool] = {
    "--swap-space": True, "--cpu-offload-gb": True, "--quantization": True, "-q": True,
    "--tokenizer-mode": True, "--tokenizer-revision": True, "--code-revision": True,
    "--distributed-executor-backend": True, "--data-parallel-size": True, "-dp": True,
    "--enable-expert-parallel": False, "--max-logprobs": True, "--max-seq-len-to-capture": True,
    "--speculative-config": True,  # ours: --decode_algo, --draft.model, --gamma
    "--tool-call-parser": True, "--reasoning-parser": True,
    "--ssl-keyfile": True, "--ssl-certfile": True, "--allowed-origins": True,
    "--middleware": True, "--response-role": True, "--scheduling-policy": True,
    "--num-scheduler-steps": True, "--limit-mm-per-prompt": True, "--task": True,
    "--runner": True, "--hf-overrides": True, "--override-generation-config": True,
    "--generation-config": True, "--compilation-config": True, "-O": True,
    "--rope-scaling": True, "--rope-theta": True, "--disable-sliding-window": False,
    "--max-parallel-loading-workers": True, "--disable-custom-all-reduce": False,
    "--enable-sleep-mode": False, "--worker-cls": True, "--config-format": True,
    "--chat-template-content-format": True, "--return-tokens-as-token-ids": False,
    "--enable-prompt-tokens-details": False, "--enable-request-id-headers": False,
    "--disable-frontend-multiprocessing": False, "--max-log-len": True,
    "--disable-log-stats": False, "--preemption-mode": True, "--num-gpu-blocks-override": True,
    "--max-num-partial-prefills": True, "--long-prefill-token-threshold": True,
    "--kv-transfer-config": True, "--otlp-traces-endpoint": True, "--mm-processor-kwargs": True,
}


class _Store(argparse.Action):
    def __init__(self, option_strings, dest, alias: Alias, **kwargs):
        self.alias = alias
        nargs = 0 if alias.const is not None else None
        super().__init__(option_strings, dest, nargs=nargs, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        alias = self.alias
        if alias.const is not None:
            setattr(namespace, self.dest, alias.const)
            return
        try:
            setattr(namespace, self.dest, alias.convert(values))  # type: ignore[misc]
        except ValueError:
            parser.error(f"{alias.flag}: invalid value {values!r}")


class _Accept(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0, default=argparse.SUPPRESS,
                         **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        pass  # the behaviour the flag asks for is the only one there is


class _Refuse(argparse.Action):
    def __init__(self, option_strings, dest, why: str, **kwargs):
        self.why = why
        super().__init__(option_strings, argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: {self.why}")


def add_vllm_flags(parser: argparse.ArgumentParser, taken: set[str]) -> None:
    """Add the table's flags; names in ``taken`` (our own flags) win over the table."""
    group = parser.add_argument_group(
        "vLLM spellings", "vLLM's flags, mapped onto the flags above (vLLM's dash spellings of "
                          "our own flags, e.g. --max-model-len, work too).")
    for alias in ALIASES:
        if alias.flag in taken:
            continue
        meta = {} if alias.const is not None else {"metavar": "VALUE"}
        group.add_argument(alias.flag, dest=alias.dest, action=_Store, alias=alias,
                           help=f"= {alias.ours}", **meta)
    for flag, why in FIXED.items():
        if flag not in taken:
            group.add_argument(flag, action=_Accept, help=f"accepted: {why}")
    for flag, why in OPPOSITE_OF_FIXED.items():
        if flag not in taken:
            group.add_argument(flag, action=_Refuse, why=why, nargs=0, help=f"refused: {why}")
    unsupported = [f for f in NOT_SUPPORTED_YET if f not in taken]
    later = parser.add_argument_group(
        "vLLM flags not supported yet",
        "Given, these stop the server with 'not supported yet': " + ", ".join(unsupported))
    for flag in unsupported:
        later.add_argument(flag, action=_Refuse, why="this vLLM flag is not supported yet",
                           nargs=1 if NOT_SUPPORTED_YET[flag] else 0, help=argparse.SUPPRESS)
