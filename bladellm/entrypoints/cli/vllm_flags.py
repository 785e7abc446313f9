"""vLLM's command-line spellings, mapped onto our config by one table.

Most vLLM flags are already ours in dash spelling (``--max-model-len``, ``--served-model-name``,
``--tensor-parallel-size``, ``--api-key``, ``--chat-template``, ``--trust-remote-code``, ...);
``ALIASES`` adds the ones whose names differ, ``FIXED`` the ones that ask for what BladeLLM always
does (accepted, their opposite refused), ``--tool-call-parser`` and ``--speculative-config`` take
values checked here (``TOOL_CALL_PARSERS``, ``speculative_config_flags``), and
``NOT_SUPPORTED_YET`` the rest of vLLM's serving flags: they fail with "not supported yet" instead
of argparse's "unrecognized arguments".
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from typing import Any, Callable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Alias:
    flag: str  # vLLM's spelling
    dest: str  # our argparse dest: f"{section}__{field}"
    ours: str  # our flag, for --help
    const: Any = None  # set for switches: the value stored
    convert: Callable[[str], Any] | None = None  # for flags with a value


def _kv_cache_dtype(value: str) -> str:
    """vLLM's ``auto`` is our ``no_quant``. vLLM's other values (fp8, fp8_e4m3, fp8_e5m2) name
    formats we do not have; our int8 cache is not a vLLM value, so it keeps its own flag."""
    if value == "auto":
        return "no_quant"
    raise ValueError(f"only auto is supported ({value} KV caches are not); for a quantized "
                     "KV cache use --kv_cache_quant int8")


ALIASES: tuple[Alias, ...] = (
    Alias("--gpu-memory-utilization", "cache__max_gpu_memory_utilization",
          "--max_gpu_memory_utilization", convert=float),
    Alias("--enable-prefix-caching", "cache__disable_prompt_cache", "no --disable_prompt_cache",
          const=False),
    Alias("--no-enable-prefix-caching", "cache__disable_prompt_cache", "--disable_prompt_cache",
          const=True),
    Alias("--kv-cache-dtype", "cache__kv_cache_quant", "--kv_cache_quant (only auto = no_quant)",
          convert=_kv_cache_dtype),
    Alias("--disable-hybrid-kv-cache-manager", "cache__disable_hybrid_kv_cache",
          "--disable_hybrid_kv_cache", const=True),
    Alias("--uvicorn-log-level", "server__log_level", "--log_level", convert=str),
    Alias("--disable-uvicorn-access-log", "server__disable_access_log", "--disable_access_log",
          const=True),
    Alias("--enforce-eager", "model__enforce_eager", "--enforce_eager", const=True),
    Alias("--no-enforce-eager", "model__enforce_eager", "no --enforce_eager", const=False),
    Alias("-tp", "parallel__tensor_parallel_size", "--tensor_parallel_size", convert=int),
    Alias("-pp", "parallel__pipeline_parallel_size", "--pipeline_parallel_size", convert=int),
)

# Flags that request BladeLLM's fixed behaviour: accepted; the opposite spelling is refused.
FIXED: dict[str, str] = {
    "--enable-chunked-prefill": "long prompts are always prefilled in chunks",
    "--disable-log-requests": "request contents are never logged",
    "--enable-auto-tool-choice": "tool calls are parsed whenever a request sends tools with "
                                 "tool_choice auto (Hermes / Llama 3 formats, auto-detected)",
}
OPPOSITE_OF_FIXED: dict[str, str] = {
    "--no-enable-chunked-prefill": "chunked prefill cannot be turned off",
    "--enable-log-requests": "logging request contents is not supported",
    # vLLM: "not disabled" = request logging on.
    "--no-disable-log-requests": "logging request contents is not supported",
}

# ---- --tool-call-parser NAME -------------------------------------------------------------------
# vLLM's parser names for the formats entrypoints/openai/tool_calls.py parses. The server has one
# parser that recognizes all of them in every request (tool_choice "auto"), and no setting that
# narrows it to one format: the name is checked, then changes nothing (said in --help and logged).
TOOL_CALL_PARSERS: dict[str, str] = {
    "hermes": "Hermes / Qwen2.5 / Qwen3: <tool_call>{\"name\", \"arguments\"}</tool_call>",
    "llama3_json": "Llama 3.x JSON: {\"name\", \"parameters\"}, optionally after <|python_tag|>, "
                   "several separated by ';'",
    "llama4_json": "vLLM's other name of llama3_json (the same parser there)",
}


def _tool_call_parser_notice(name: str) -> str:
    return (f"--tool-call-parser {name}: accepted, changes nothing: BladeLLM parses tool calls in "
            f"every format it knows ({', '.join(TOOL_CALL_PARSERS)}: Hermes <tool_call> and "
            "Llama 3 JSON) whenever a request sends tools with tool_choice auto, whichever parser "
            "is named")


class _ToolCallParser(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, argparse.SUPPRESS, default=argparse.SUPPRESS,
                         metavar="NAME", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if values not in TOOL_CALL_PARSERS:
            parser.error(f"{option_string}: parser {values!r} is not supported; supported: "
                         f"{', '.join(TOOL_CALL_PARSERS)} (all of them parsed, auto-detected)")
        # Logging is configured only after the flags are parsed: a warning still reaches stderr.
        logger.warning("%s", _tool_call_parser_notice(values))


# ---- --speculative-config JSON ------------------------------------------------------------------
# vLLM's SpeculativeConfig keys (vllm/config/speculative.py) that have a faithful equivalent here.
SPECULATIVE_KEYS = ("method", "model", "num_speculative_tokens", "draft_tensor_parallel_size")
_SPEC_DESTS = {"speculative__decode_algo": "--decode_algo", "speculative__gamma": "--gamma",
               "draft__model": "--draft.model"}
_LOOK_AHEAD_HINT = (
    "BladeLLM's draft-free speculation is --decode_algo look_ahead (Jacobi window plus n-gram "
    "pool plus prompt lookup of the last 3..1 tokens; see docs/speculative.md): not the same "
    "proposer, so it is not mapped from this method")
_REFUSED_METHODS = {
    "ngram": "vLLM's n-gram proposer (prompt_lookup_min..prompt_lookup_max-token matches only) "
             "has no equivalent. " + _LOOK_AHEAD_HINT,
    "ngram_gpu": "see ngram. " + _LOOK_AHEAD_HINT,
    "suffix": "suffix decoding is not implemented. " + _LOOK_AHEAD_HINT,
}


def speculative_config_flags(text: str) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` JSON as our argparse dests; ``ValueError`` (without the
    flag's name) when it has no faithful equivalent here."""
    try:
        spec = json.loads(text)
    except ValueError:
        spec = None
    if not isinstance(spec, dict):
        raise ValueError(f"expected a JSON object, e.g. '{{\"model\": \"DIR\", "
                         f"\"num_speculative_tokens\": 4}}', got {text!r}")
    method, model = spec.get("method"), spec.get("model")
    if method is None:
        if model is None:
            raise ValueError("needs 'method' or 'model'")
        if isinstance(model, str) and any(t in model.lower()
                                          for t in ("eagle", "medusa", "mlp_speculator")):
            # vLLM picks these methods from such a model name; they are not draft models.
            raise ValueError(f"model {model!r} looks like an EAGLE / Medusa / MLP speculator "
                             "head: not supported; only draft models (method draft_model)")
        method = "draft_model"
    if method in _REFUSED_METHODS:
        raise ValueError(f"method {method!r} is not supported: {_REFUSED_METHODS[method]}")
    if method != "draft_model":
        raise ValueError(f"method {method!r} is not supported; supported: draft_model (= "
                         "--decode_algo sps); draft-free: --decode_algo look_ahead")
    unknown = [k for k in spec if k not in SPECULATIVE_KEYS]
    if unknown:
        raise ValueError(f"key(s) {', '.join(map(repr, unknown))} not supported; supported: "
                         f"{', '.join(SPECULATIVE_KEYS)}")
    if not isinstance(model, str):
        raise ValueError("method draft_model needs 'model': the draft model directory")
    k = spec.get("num_speculative_tokens")
    if k is None:
        raise ValueError("num_speculative_tokens is required with a draft model (= --gamma)")
    if isinstance(k, bool) or not isinstance(k, int):
        raise ValueError(f"num_speculative_tokens: expected an integer, got {k!r}")
    tp = spec.get("draft_tensor_parallel_size", 1)
    if tp != 1 or isinstance(tp, bool):
        raise ValueError(f"draft_tensor_parallel_size {tp!r}: only 1 is supported (speculative "
                         "decoding runs without tensor parallelism)")
    from bladellm.config import DraftConfig, SpeculativeConfig  # validation stays the config's

    try:
        SpeculativeConfig(decode_algo="sps", gamma=k)
    except ValueError as exc:
        raise ValueError(f"num_speculative_tokens ({exc})") from None
    try:
        DraftConfig(model=model)
    except ValueError as exc:
        raise ValueError(f"model ({exc})") from None
    return {"speculative__decode_algo": "sps", "draft__model": model, "speculative__gamma": k}


_SPEC_MARK = "vllm_speculative_config"  # no "__": configs_from_namespace ignores it


def _conflict(flag: str) -> str:
    return (f"{flag}: cannot be combined with --speculative-config, which sets --decode_algo, "
            "--draft.model and --gamma; give one or the other")


class _SpeculativeConfig(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, argparse.SUPPRESS, default=argparse.SUPPRESS,
                         metavar="JSON", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        for dest, flag in _SPEC_DESTS.items():
            if hasattr(namespace, dest):
                parser.error(_conflict(flag))
        try:
            dests = speculative_config_flags(values)
        except ValueError as exc:
            parser.error(f"{option_string}: {exc}")
        for dest, value in dests.items():
            setattr(namespace, dest, value)
        setattr(namespace, _SPEC_MARK, True)
        logger.info("%s = --decode_algo sps --draft.model %s --gamma %d", option_string,
                    dests["draft__model"], dests["speculative__gamma"])


class _NotAfterSpeculativeConfig:
    """Mixed into our own --decode_algo / --gamma / --draft.model actions: given after
    --speculative-config they would silently override what it set."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, _SPEC_MARK, False):
            parser.error(_conflict(option_string))
        super().__call__(parser, namespace, values, option_string)  # type: ignore[misc]


def _guard_speculative_flags(parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        if action.dest in _SPEC_DESTS and not isinstance(action, _NotAfterSpeculativeConfig):
            cls = type(action)
            action.__class__ = type(f"Guarded{cls.__name__}", (_NotAfterSpeculativeConfig, cls),
                                    {})


# vLLM serving flags without a BladeLLM equivalent yet; True = the flag takes a value.
NOT_SUPPORTED_YET: dict[str, bool] = {
    "--swap-space": True, "--cpu-offload-gb": True, "-q": True,
    "--tokenizer-mode": True, "--tokenizer-revision": True, "--code-revision": True,
    "--distributed-executor-backend": True, "--data-parallel-size": True, "-dp": True,
    "--max-logprobs": True, "--max-seq-len-to-capture": True,
    "--ssl-keyfile": True, "--ssl-certfile": True, "--allowed-origins": True,
    "--middleware": True, "--response-role": True,
    "--num-scheduler-steps": True, "--task": True,
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
        except ValueError as e:
            parser.error(f"{alias.flag}: invalid value {values!r}: {e}")


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
    if "--tool-call-parser" not in taken:
        group.add_argument(
            "--tool-call-parser", action=_ToolCallParser,
            help=f"one of {', '.join(TOOL_CALL_PARSERS)}; accepted, changes nothing: tool calls "
                 "in all of these formats are parsed whichever is named (Hermes <tool_call> and "
                 "Llama 3 JSON, auto-detected; logged at start); other names are refused")
    if "--speculative-config" not in taken:
        group.add_argument(
            "--speculative-config", action=_SpeculativeConfig,
            help='{"model": DIR, "num_speculative_tokens": K} (method draft_model, the default '
                 'with a model) = --decode_algo sps --draft.model DIR --gamma K; '
                 '"draft_tensor_parallel_size": 1 allowed. Other methods (ngram, eagle, ...) and '
                 "keys are refused (draft-free here: --decode_algo look_ahead, not the same as "
                 "ngram); not with --decode_algo / --gamma / --draft.model")
        _guard_speculative_flags(parser)
    unsupported = [f for f in NOT_SUPPORTED_YET if f not in taken]
    later = parser.add_argument_group(
        "vLLM flags not supported yet",
        "Given, these stop the server with 'not supported yet': " + ", ".join(unsupported))
    for flag in unsupported:
        later.add_argument(flag, action=_Refuse, why="this vLLM flag is not supported yet",
                           nargs=1 if NOT_SUPPORTED_YET[flag] else 0, help=argparse.SUPPRESS)
