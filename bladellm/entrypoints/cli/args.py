"""Command-line flags generated from the config dataclasses.

Every field of every section of ``EngineConfig`` (and of ``ServerConfig``) becomes a flag named
after the field: ``--max_num_seqs``, with the dash spelling ``--max-num-seqs`` accepted too. The
help text is the field's ``metadata["help"]`` plus its default. Only flags given on the command
line are passed to the dataclasses, so their defaults (and ``__post_init__`` validation) stay the
single source of truth; a ``ValueError`` from validation becomes an argparse error naming the flag.

A section may set a class attribute ``cli_prefix = "draft."`` to spell its flags ``--draft.model``.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from typing import Any

from bladellm.config import EngineConfig
from bladellm.entrypoints.cli.vllm_flags import add_vllm_flags
from bladellm.entrypoints.openai.config import ServerConfig

_METAVARS = {int: "N", float: "X", str: "TEXT"}
_SEP = "__"  # argparse dest = f"{section}{_SEP}{field}"; "" section = EngineConfig's own fields


@dataclasses.dataclass
class _FlagSpec:
    flag: str
    dest: str
    kwargs: dict[str, Any]


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
        if set(args) <= {int, str}:  # e.g. `int | str` sizes: keep the text, the config parses it
            return str, True
        raise TypeError(f"unsupported union type {tp!r} for a CLI flag")
    return tp, False


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def _escape(text: str) -> str:
    """Escape ``%`` for argparse; help texts that already wrote ``%%`` stay as they are."""
    return text.replace("%%", "%").replace("%", "%%")


def _flag_kwargs(f: dataclasses.Field, tp: Any) -> dict[str, Any]:
    """argparse keyword arguments for one dataclass field of (resolved) type ``tp``."""
    help_text = f.metadata.get("help", "")
    base, optional = _unwrap_optional(tp)
    default = f.default if f.default is not dataclasses.MISSING else None
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        default = f.default_factory()  # type: ignore[misc]
    kwargs: dict[str, Any] = {"default": argparse.SUPPRESS}
    if base is bool:
        if default is True:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["action"] = "store_true"
        kwargs["help"] = _escape(f"{help_text} (default: {default})")
        return kwargs
    origin = typing.get_origin(base)
    if origin in (list, tuple):
        (item,) = typing.get_args(base)[:1] or (str,)
        kwargs["nargs"] = "+"
        kwargs["type"] = item
        shown = " ".join(map(str, default)) if default else default
    elif origin is typing.Literal:
        kwargs["choices"] = list(typing.get_args(base))
        kwargs["type"] = type(kwargs["choices"][0])
        shown = default
    elif isinstance(base, type) and issubclass(base, enum.Enum):
        kwargs["choices"] = [m.value for m in base]
        kwargs["type"] = type(kwargs["choices"][0])
        shown = default.value if isinstance(default, enum.Enum) else default
    elif base in (int, float, str):
        kwargs["type"] = base
        shown = default
    else:
        raise TypeError(f"unsupported type {tp!r} for a CLI flag (field {f.name})")
    if "choices" in f.metadata:
        kwargs["choices"] = list(f.metadata["choices"])
    if "choices" not in kwargs:
        kwargs["metavar"] = _METAVARS.get(kwargs["type"], "VALUE")
    kwargs["help"] = _escape(f"{help_text} (default: {shown})")
    return kwargs


def _section_specs(section: str, klass: type) -> list[_FlagSpec]:
    hints = typing.get_type_hints(klass)
    prefix = getattr(klass, "cli_prefix", "")
    specs = []
    for f in dataclasses.fields(klass):
        if not f.init or f.metadata.get("cli") is False:
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            continue  # nested sections are handled by the caller
        specs.append(_FlagSpec(flag=f"--{prefix}{f.name}", dest=f"{section}{_SEP}{f.name}",
                               kwargs=_flag_kwargs(f, hints[f.name])))
    return specs


def _engine_sections() -> dict[str, type]:
    hints = typing.get_type_hints(EngineConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(EngineConfig)
            if dataclasses.is_dataclass(hints[f.name])}


def _all_groups(with_server: bool = True) -> list[tuple[str, str, list[_FlagSpec]]]:
    groups = [(name, klass.__name__, _section_specs(name, klass))
              for name, klass in _engine_sections().items()]
    groups.append(("", "EngineConfig", _section_specs("", EngineConfig)))
    if with_server:
        groups.append(("server", "ServerConfig", _section_specs("server", ServerConfig)))
    return groups


def make_parser(prog: str = "blade_llm_server", with_server: bool = True,
                description: str = "BladeLLM OpenAI-compatible HTTP server."
                ) -> argparse.ArgumentParser:
    """``with_server=False``: the engine's flags only (``blade_llm_worker``, which builds the
    same ``EngineConfig`` from the same flags but serves no HTTP)."""
    parser = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False)
    # bladellm's own version, not the HTTP server module's helper: importing that module pulls
    # in FastAPI and the serving stack (seconds) before blade_llm_server has started
    # the engine core, which is what the early start is there to overlap.
    import bladellm

    parser.add_argument("--version", action="version", version=f"%(prog)s {bladellm.__version__}")
    seen: dict[str, str] = {}
    for _, title, specs in _all_groups(with_server):
        group = parser.add_argument_group(title)
        for spec in specs:
            names = [spec.flag]
            dashed = spec.flag.replace("_", "-")
            if dashed != spec.flag:
                names.append(dashed)
            for name in names:
                if name in seen:
                    raise ValueError(f"flag {name} is defined by both {seen[name]} and {title}; "
                                     "give one section a cli_prefix")
                seen[name] = title
            group.add_argument(*names, dest=spec.dest, **spec.kwargs)
    add_vllm_flags(parser, set(seen))
    return parser


def configs_from_namespace(ns: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """Build the configs from parsed flags; raises ValueError (naming the flag) when invalid."""
    given: dict[str, dict[str, Any]] = {}
    for dest, value in vars(ns).items():
        if _SEP in dest:
            section, name = dest.split(_SEP, 1)
            given.setdefault(section, {})[name] = value
    sections = {name: klass(**given.get(name, {})) for name, klass in _engine_sections().items()}
    engine = EngineConfig(**sections, **given.get("", {}))
    server = ServerConfig(**given.get("server", {}))
    return engine, server


def parse_args(argv: list[str] | None = None,
               parser: argparse.ArgumentParser | None = None) -> tuple[EngineConfig, ServerConfig]:
    parser = parser or make_parser()
    ns = parser.parse_args(argv)
    try:
        return configs_from_namespace(ns)
    except ValueError as exc:
        parser.error(str(exc))  # exits with status 2 and the usage line
        raise  # unreachable; keeps type checkers happy


# ---- one config dataclass as a whole CLI (blade_llm_router, blade_llm_check) ---------------------


def add_dataclass_flags(parser: argparse.ArgumentParser, klass: type, section: str = "cfg",
                        title: str | None = None) -> None:
    """Add a flag (and its dash spelling) per field of ``klass``, generated as for the server."""
    group = parser.add_argument_group(title or klass.__name__)
    for spec in _section_specs(section, klass):
        names = [spec.flag]
        if spec.flag.replace("_", "-") != spec.flag:
            names.append(spec.flag.replace("_", "-"))
        group.add_argument(*names, dest=spec.dest, **spec.kwargs)


def dataclass_from_namespace(ns: argparse.Namespace, klass: type, section: str = "cfg") -> Any:
    """Build ``klass`` from the flags given (defaults stay the dataclass's own)."""
    prefix = f"{section}{_SEP}"
    return klass(**{k[len(prefix):]: v for k, v in vars(ns).items() if k.startswith(prefix)})
