"""What transformers resolved for a model directory, remembered so later starts skip its imports.

transformers 5 pulls most of the library in to build a config or pick a tokenizer class:
``from transformers import LlamaConfig`` or ``AutoTokenizer`` imports accelerate,
``torch.distributed.tensor``, ``torch._dynamo`` and sympy (seconds; docs/cpu.md), in both
processes, on the critical path of every start. What the engine takes from them is small and
fixed for a given directory and transformers version:

- **the config**: the engine reads only attributes (``hidden_size``, ``rope_parameters``, ...).
  The first start builds it with ``AutoConfig`` as always and records every public attribute the
  object answers (properties included, nested sub-configs recursively) and its ``to_json_string``;
  later starts get a ``ConfigSnapshot`` that answers the same. Code that needs a real
  ``PretrainedConfig`` (``blade_llm_check`` builds a transformers model) calls ``AutoConfig``.
- **the tokenizer class**: ``AutoTokenizer`` picks a class from ``tokenizer_config.json``, the
  config's model type and its own tables. The first start lets it pick, loads the directory a
  second time through the picked class directly, and records the class only where both
  tokenizers agree (vocabulary, special tokens, chat template, added tokens, a probe text's ids);
  later starts call that class's ``from_pretrained``, which imports only the tokenizer modules.

An entry is keyed by the directory's real path, the bytes of the files that decide the result
and transformers' installed version (read from its metadata, not by importing it); any change
makes a new entry. Remote code (``--trust_remote_code``) is never remembered. Entries live in
``BLADELLM_RESOLUTION_CACHE_DIR`` (default ``BLADELLM_CACHE_DIR/resolved``);
``BLADELLM_RESOLUTION_CACHE=0`` turns this off. A corrupt or
unwritable entry only costs the slow path.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bladellm import envs

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
# The files whose bytes decide what transformers resolves for a directory.
CONFIG_FILES = ("config.json",)
TOKENIZER_FILES = ("tokenizer_config.json", "config.json", "tokenizer.json",
                   "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
                   "tekken.json", "tokenizer.model")
# Installed packages that change which class AutoTokenizer picks (mistral models get
# MistralCommonBackend where mistral-common is installed and tekken.json exists).
TOKENIZER_PACKAGES = ("mistral_common", "sentencepiece")
# Encoded one after another by the tokenizer agreement check (ASCII, digits, whitespace runs,
# non-Latin scripts, an emoji: where pre-tokenizers and normalizers differ).
PROBE_TEXT = "Hello, world!  12345 café Ünïcödé 你好 🤖\n\tdef f(x): return x ** 2"


class _Unrecordable(Exception):
    """An attribute value that the snapshot cannot hold exactly."""


class _LazyDtype:
    """A torch dtype attribute of a snapshot, named until read: the API process reads the
    config without importing torch (it never reads the dtype)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def resolve(self) -> Any:
        import torch

        return getattr(torch, self.name)


class ConfigSnapshot:
    """A model config as transformers built it, frozen: every public attribute it answered,
    ``to_dict()`` and ``to_json_string()``. Read-only; what it never answered raises
    ``AttributeError`` as the config did."""

    __slots__ = ("_attrs", "_dict", "_json", "_class", "_unrecorded")

    def __init__(self, attrs: dict[str, Any], as_dict: dict[str, Any], as_json: str,
                 class_name: str, unrecorded: tuple[str, ...] = ()) -> None:
        object.__setattr__(self, "_attrs", attrs)
        object.__setattr__(self, "_dict", as_dict)
        object.__setattr__(self, "_json", as_json)
        object.__setattr__(self, "_class", class_name)
        object.__setattr__(self, "_unrecorded", unrecorded)

    def __getattr__(self, name: str) -> Any:
        attrs = object.__getattribute__(self, "_attrs")
        try:
            value = attrs[name]
        except KeyError:
            pass
        else:
            if isinstance(value, _LazyDtype):
                value = attrs[name] = value.resolve()
            return value
        if name in object.__getattribute__(self, "_unrecorded"):
            # Not AttributeError: getattr(config, name, default) must not quietly answer what
            # the real config would not have.
            raise RuntimeError(f"{self._class}.{name} was not recorded in the config snapshot "
                               f"(set BLADELLM_RESOLUTION_CACHE=0)")
        raise AttributeError(f"{self._class} has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a config snapshot is read-only (setting {name!r})")

    def __getstate__(self) -> tuple:
        return (self._attrs, self._dict, self._json, self._class, self._unrecorded)

    def __setstate__(self, state: tuple) -> None:
        for name, value in zip(self.__slots__, state):
            object.__setattr__(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._dict)

    def to_json_string(self) -> str:
        return self._json

    def __repr__(self) -> str:
        return f"{self._class}(snapshot) {self._json}"


def _encode(value: Any) -> Any:
    """A JSON form of ``value`` that ``_decode`` turns back into an equal value of the same
    types (tuples, int dict keys, torch dtypes and sub-configs kept), or ``_Unrecordable``."""
    if isinstance(value, type):  # a class (``sub_configs`` maps names to config classes)
        raise _Unrecordable(f"class {value.__name__}")
    if value is None or type(value) in (bool, int, float, str):  # not subclasses (enums)
        return value
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v) for v in value]}
    if isinstance(value, (set, frozenset)):
        return {"__set__": sorted((_encode(v) for v in value), key=repr),
                "frozen": isinstance(value, frozenset)}
    if isinstance(value, dict):
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in value):
            raise _Unrecordable(f"dict keys {list(value)[:3]}")
        return {"__dict__": [[k, _encode(v)] for k, v in value.items()]}
    module = type(value).__module__
    if module == "torch" and type(value).__name__ == "dtype":
        return {"__dtype__": str(value).removeprefix("torch.")}
    if hasattr(value, "to_json_string") and hasattr(value, "to_dict"):  # a nested config
        return {"__config__": _config_record(value)}
    raise _Unrecordable(f"{type(value).__name__} value")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tuple__" in value:
        return tuple(_decode(v) for v in value["__tuple__"])
    if "__set__" in value:
        items = (_decode(v) for v in value["__set__"])
        return frozenset(items) if value["frozen"] else set(items)
    if "__dict__" in value:
        return {k: _decode(v) for k, v in value["__dict__"]}
    if "__dtype__" in value:
        import torch

        return getattr(torch, value["__dtype__"])
    if "__config__" in value:
        return _snapshot_from_record(value["__config__"])
    raise ValueError(f"unknown record {sorted(value)[:3]}")


def _public_attributes(config: Any) -> tuple[dict[str, Any], list[str]]:
    """Every public, non-callable attribute ``config`` answers (fields, properties and
    ``attribute_map`` aliases), plus ``_name_or_path`` (AutoTokenizer reads it); and the names
    whose reading raised."""
    aliases = list(getattr(type(config), "attribute_map", None) or {})
    names = sorted({n for n in dir(config) if not n.startswith("_")} | set(aliases)
                   | {"_name_or_path"})
    attrs, raised = {}, []
    # Reading deprecated aliases (torch_dtype, use_return_dict) makes transformers warn once.
    hf_logger = logging.getLogger("transformers")
    level = hf_logger.level
    hf_logger.setLevel(logging.ERROR)
    try:
        for name in names:
            try:
                value = getattr(config, name)
            except AttributeError:
                continue
            except Exception:  # noqa: BLE001 - a property that raises: the snapshot raises too
                raised.append(name)
                continue
            if not callable(value) or isinstance(value, type):  # methods are not data
                attrs[name] = value
    finally:
        hf_logger.setLevel(level)
    return attrs, raised


def _config_record(config: Any) -> dict[str, Any]:
    encoded = {}
    attrs, unrecorded = _public_attributes(config)
    for name, value in attrs.items():
        try:
            encoded[name] = _encode(value)
        except _Unrecordable:
            unrecorded.append(name)  # reading it from the snapshot raises
    record = {"class": type(config).__name__, "attrs": encoded, "unrecorded": unrecorded,
              "dict": _encode(config.to_dict()), "json": config.to_json_string()}
    # Exactness: every attribute must come back equal (NaN-free configs compare by value).
    back = _snapshot_from_record(json.loads(json.dumps(record)))
    for name in encoded:
        if not _same(getattr(back, name), attrs[name]):
            raise _Unrecordable(f"attribute {name!r} does not round-trip")
    return record


def _same(a: Any, b: Any) -> bool:
    if hasattr(b, "to_json_string") and not isinstance(b, (str, bytes)):
        return isinstance(a, ConfigSnapshot) and a.to_json_string() == b.to_json_string()
    return type(a) is type(b) and a == b


def _decode_attr(value: Any) -> Any:
    if isinstance(value, dict) and "__dtype__" in value:
        return _LazyDtype(value["__dtype__"])
    return _decode(value)


def _snapshot_from_record(record: dict[str, Any]) -> ConfigSnapshot:
    return ConfigSnapshot({k: _decode_attr(v) for k, v in record["attrs"].items()},
                          _decode(record["dict"]), record["json"], record["class"],
                          tuple(record["unrecorded"]))


def _transformers_version() -> str | None:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def _entry_path(kind: str, directory: str, files: tuple[str, ...],
                packages: tuple[str, ...] = ()) -> Path | None:
    """Where the entry for ``directory`` lives, or None when the cache is off, ``directory`` is
    not a local directory (a hub id is resolved by transformers every time), a file cannot be
    read, or transformers' version cannot be read."""
    if not envs.resolution_cache_enabled() or not os.path.isdir(directory):
        return None
    version = _transformers_version()
    if version is None:
        return None
    # The path as given and as resolved: transformers matches some checkpoints by their name.
    spelled, real = os.path.abspath(directory), os.path.realpath(directory)
    installed = [p for p in packages if importlib.util.find_spec(p) is not None]
    h = hashlib.sha256(f"{FORMAT_VERSION}\0{kind}\0{spelled}\0{real}\0{version}\0"
                       f"{installed}".encode())
    for name in files:
        try:
            h.update(name.encode() + b"\0" + Path(real, name).read_bytes() + b"\0")
        except FileNotFoundError:
            h.update(name.encode() + b"\0-\0")
        except OSError:  # unreadable: let transformers report it
            return None
    return envs.resolution_cache_dir() / f"{kind}-{h.hexdigest()[:32]}.json"


def _read(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            entry = json.load(f)
        return entry if isinstance(entry, dict) and entry.get("format") == FORMAT_VERSION \
            else None
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.warning("ignoring unreadable %s: %s", path, e)
        return None


def _write(path: Path, entry: dict[str, Any]) -> None:
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"format": FORMAT_VERSION, **entry}, f)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep a shared cache directory private
        os.replace(tmp, path)  # atomic: the other process reads the old state or this one
    except OSError as e:
        logger.debug("cannot write %s: %s", path, e)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def remembered_config(model_dir: str, trust_remote_code: bool,
                      load: Callable[[], Any]) -> Any:
    """``load()`` (transformers' config for ``model_dir``) the first time; a ``ConfigSnapshot``
    of what it returned on later calls for the same directory bytes and transformers."""
    path = None if trust_remote_code else _entry_path("config", model_dir, CONFIG_FILES)
    entry = _read(path) if path is not None else None
    if entry is not None:
        try:
            return _snapshot_from_record(entry["config"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            logger.warning("ignoring corrupt %s: %s", path, e)
    config = load()
    if path is not None:
        try:
            record = _config_record(config)
        except Exception as e:  # noqa: BLE001 - anything unexpected: just do not remember it
            logger.debug("config of %s not remembered: %s", model_dir, e)
        else:
            _write(path, {"config": record})
    return config


def _tokenizer_facts(tok: Any) -> dict[str, Any]:
    return {"class": type(tok).__name__, "vocab": tok.get_vocab(),
            "special": {k: str(v) for k, v in tok.special_tokens_map.items()},
            "added": {k: str(v) for k, v in tok.added_tokens_decoder.items()},
            "chat_template": getattr(tok, "chat_template", None),
            "bos": tok.bos_token_id, "eos": tok.eos_token_id, "pad": tok.pad_token_id,
            "probe": tok(PROBE_TEXT)["input_ids"],
            "max_len": tok.model_max_length}


def remembered_tokenizer(tokenizer_dir: str, trust_remote_code: bool,
                         load: Callable[[], Any]) -> Any:
    """``load()`` (``AutoTokenizer`` for ``tokenizer_dir``) the first time; on later calls the
    class it picked, loaded directly, where the first call proved that gives the same
    tokenizer."""
    path = None if trust_remote_code else _entry_path("tokenizer", tokenizer_dir,
                                                      TOKENIZER_FILES, TOKENIZER_PACKAGES)
    entry = _read(path) if path is not None else None
    if entry is not None and isinstance(entry.get("class"), str):
        import transformers

        cls = getattr(transformers, entry["class"], None)
        if isinstance(cls, type):
            try:
                return cls.from_pretrained(tokenizer_dir)
            except Exception as e:  # noqa: BLE001 - whatever changed, AutoTokenizer decides
                logger.warning("remembered tokenizer class %s failed on %s (%s); asking "
                               "AutoTokenizer", entry["class"], tokenizer_dir, e)
        entry = None
    tok = load()
    if path is None or entry is not None:
        return tok
    import transformers

    name = type(tok).__name__
    cls = getattr(transformers, name, None)
    verdict: str | None = None
    if cls is type(tok):
        try:
            direct = cls.from_pretrained(tokenizer_dir)
            if _tokenizer_facts(direct) == _tokenizer_facts(tok):
                verdict = name
        except Exception as e:  # noqa: BLE001 - any failure: just do not remember a class
            logger.debug("direct load of %s via %s failed: %s", tokenizer_dir, name, e)
    _write(path, {"class": verdict})  # null: AutoTokenizer every time, decided once
    return tok
