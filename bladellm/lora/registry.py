"""API side: which adapter a request's ``model`` names (docs/lora.md, "Selecting an adapter").

A ``model`` value is, in order: the base model's served name (no adapter), a registered adapter
name (``--lora_modules`` or ``POST /v1/load_lora_adapter``), or a path, absolute or relative to
a ``--lora_root``. A path is resolved with ``os.path.realpath`` (``~`` expanded, symlinks and
``..`` included) and must then lie inside a resolved root; anything else is "not found", without
saying whether the path exists. The adapter directory is checked here (config and safetensors
header, no weights read), so a bad adapter is a 400 before the request reaches the engine.

Bounded: an adapter reached by path is identified by its resolved directory (``./a``, ``a/.``
and ``/root/a`` are one adapter), named by its path under the root (``/v1/models`` shows no
server path), and is a dynamic entry: at most ``--max_lora_entries`` dynamic entries (those and
``/v1/load_lora_adapter``'s) exist at once; past that, the least recently used adapter reached
by path that no request is using is forgotten (a later request reloads it).

Thread-safe: the API server resolves in a worker thread (the directory checks read files) while
the event loop acquires and releases; file checks run outside the lock.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections import OrderedDict
from typing import Any

from bladellm.lora.adapter import BaseShapes, LoRAError, validate_dir
from bladellm.lora.request import LoRARequest


logger = logging.getLogger(__name__)

MAX_NAME_LEN = 128  # a user-chosen adapter name
MAX_MODEL_LEN = 1024  # a request's ``model`` naming an adapter by path


class LoRANotFoundError(LookupError):
    """No such adapter (HTTP 404)."""


class LoRARegistryFullError(LoRAError):
    """Every dynamic entry is in use (``--max_lora_entries``)."""


class LoRARegistry:
    def __init__(self, config: Any, hf_config: Any, base_name: str | None = None) -> None:
        self.base_name = base_name  # the base model's served name, when the caller knows it
        self.max_rank = config.max_lora_rank
        self.roots = [os.path.realpath(r) for r in config.lora_root or []]
        for root, given in zip(self.roots, config.lora_root or []):
            if not os.path.isdir(root):
                raise ValueError(f"--lora_root: {given!r} is not a directory")
        self.base = BaseShapes.from_hf_config(hf_config)
        self._by_name: dict[str, LoRARequest] = {}
        self._by_id: dict[int, LoRARequest] = {}  # ids are never reused, even after remove()
        self._ids = itertools.count(1)
        self.max_entries = getattr(config, "max_lora_entries", 256)
        self._by_path: OrderedDict[str, LoRARequest] = OrderedDict()  # by path; LRU first
        self._dynamic: set[str] = set()  # names of /v1/load_lora_adapter's entries
        self._in_use: dict[int, int] = {}  # lora id -> requests running with it
        self._lock = threading.RLock()  # over the dicts above, never over file reads
        for name, path in config.named_modules.items():
            try:
                self.add(name, path, trusted=True, named=True, dynamic=False)
            except (LoRAError, LoRANotFoundError) as exc:
                raise ValueError(f"--lora_modules {name}={path}: {exc}") from None
        if not self.roots and not self._by_name:
            logger.warning("--enable_lora without --lora_root or --lora_modules: no adapter can "
                           "be used (requests name adapters by a path under a --lora_root, or "
                           "by a name from --lora_modules)")

    def adapters(self) -> list[LoRARequest]:
        return list(self._by_name.values())

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def set_base_name(self, name: str) -> None:
        """The base model's served name (the API side knows it): a ``model`` equal to it picks
        the base model, so an adapter registered under it could never be reached."""
        self.base_name = name
        if name in self._by_name:
            raise ValueError(f"--lora_modules {name}={self._by_name[name].lora_path}: "
                             f"'{name}' is the base model's served name")

    def check_name(self, name: str, real: str | None = None) -> None:
        """A name given by the user (``--lora_modules``, ``/v1/load_lora_adapter``): a plain
        identifier, as vLLM's, so it can never shadow the base model or a path a request could
        name. ``real``: the adapter's resolved directory (a name equal to the adapter's own
        directory under a ``--lora_root`` is fine: both select the same adapter)."""
        if not name:
            raise LoRAError("lora_name: must not be empty")
        if len(name) > MAX_NAME_LEN:
            raise LoRAError(f"lora_name: at most {MAX_NAME_LEN} characters, got {len(name)}")
        if name != name.strip() or any(c in name for c in "/\\\x00") or name in (".", ".."):
            raise LoRAError(f"lora_name: {name!r} must be a plain name (no '/', '\\', "
                            "surrounding spaces, '.' or '..'): names that look like paths would "
                            "shadow adapters addressed by path")
        if self.base_name is not None and name == self.base_name:
            raise LoRAError(f"lora_name: '{name}' is the base model's served name; an adapter "
                            "registered under it could never be selected")
        if name in self._by_name:
            raise LoRAError(f"The lora adapter '{name}' has already been loaded.")
        for root in self.roots:
            under = os.path.realpath(os.path.join(root, name))
            if os.path.exists(under) and under != real:
                raise LoRAError(f"lora_name: '{name}' is also a path under a --lora_root "
                                "naming another adapter; pick another name")

    def add(self, name: str, path: str, *, trusted: bool = False,
            named: bool = False, dynamic: bool = True) -> LoRARequest:
        """Register an adapter. ``trusted`` (operator flags) skips the ``--lora_root`` check;
        ``named``: ``name`` was chosen by the user (checked by ``check_name``); ``dynamic``:
        it counts against ``--max_lora_entries`` (all but ``--lora_modules``)."""
        if not name:
            raise LoRAError("lora_name: must not be empty")
        if name in self._by_name:
            raise LoRAError(f"The lora adapter '{name}' has already been loaded.")
        real = os.path.realpath(path) if trusted else self.resolve_path(path)
        if named:
            self.check_name(name, real)
        try:
            validate_dir(real, self.max_rank, self.base)
        except FileNotFoundError:
            raise LoRANotFoundError(f"no LoRA adapter at '{path}'") from None
        with self._lock:
            if name in self._by_name:
                raise LoRAError(f"The lora adapter '{name}' has already been loaded.")
            if dynamic:
                self._make_room()
            req = self._register(name, real)
            if dynamic:
                self._dynamic.add(name)
            return req

    def _register(self, name: str, real: str) -> LoRARequest:
        lora_id = next(self._ids)
        while lora_id in self._by_id:  # taken by an adopted (user-numbered) adapter
            lora_id = next(self._ids)
        req = LoRARequest(name, lora_id, real)
        self._by_name[name] = req
        self._by_id[lora_id] = req
        return req

    # ---- bounded dynamic entries ----------------------------------------------------------------
    def acquire(self, req: LoRARequest) -> None:
        """A request runs with ``req``: it is not evicted until ``release``."""
        with self._lock:
            self._in_use[req.lora_int_id] = self._in_use.get(req.lora_int_id, 0) + 1

    def release(self, req: LoRARequest) -> None:
        with self._lock:
            left = self._in_use.get(req.lora_int_id, 0) - 1
            if left > 0:
                self._in_use[req.lora_int_id] = left
            else:
                self._in_use.pop(req.lora_int_id, None)

    def holds(self, req: LoRARequest) -> int:
        """How many requests are running with ``req``."""
        with self._lock:
            return self._in_use.get(req.lora_int_id, 0)

    @property
    def num_dynamic(self) -> int:
        return len(self._by_path) + len(self._dynamic)

    def _make_room(self) -> None:
        """Below ``--max_lora_entries`` dynamic entries, evicting the least recently used
        unused adapter reached by path if need be."""
        if self.num_dynamic < self.max_entries:
            return
        for real, req in self._by_path.items():
            if not self._in_use.get(req.lora_int_id):
                del self._by_path[real]
                self._by_name.pop(req.lora_name, None)
                self._by_id.pop(req.lora_int_id, None)
                logger.info("LoRA adapter '%s' forgotten (least recently used of "
                            "--max_lora_entries %d)", req.lora_name, self.max_entries)
                return
        raise LoRARegistryFullError(
            f"{self.num_dynamic} LoRA adapters are registered and in use (--max_lora_entries "
            f"{self.max_entries}); retry later or unload one (/v1/unload_lora_adapter)")

    def adopt(self, req: LoRARequest) -> LoRARequest:
        """A ``LoRARequest`` the offline user built (vLLM style, with their own id): its path is
        the user's own, so it is read as given, and checked like ``add``'s. The id must not
        already stand for another adapter (KV blocks cached for one would serve the other).
        Returns the request with its resolved path (the known one when seen before)."""
        known = self._by_id.get(req.lora_int_id)
        real = os.path.realpath(req.lora_path)
        if known is not None:
            if known.lora_path != real:
                raise ValueError(f"lora_int_id: {req.lora_int_id} already names adapter "
                                 f"'{known.lora_name}' at '{known.lora_path}', not "
                                 f"'{req.lora_path}'")
            return known
        try:
            validate_dir(real, self.max_rank, self.base)
        except FileNotFoundError:
            raise LoRANotFoundError(f"no LoRA adapter at '{req.lora_path}'") from None
        except (LoRAError, OSError) as exc:
            raise LoRAError(f"LoRA adapter at '{req.lora_path}': {exc}") from None
        adopted = LoRARequest(req.lora_name, req.lora_int_id, real)
        with self._lock:
            self._by_id[req.lora_int_id] = adopted
        return adopted

    def remove(self, name: str) -> LoRARequest:
        with self._lock:
            req = self._by_name.pop(name, None)
            if req is None:
                raise LoRANotFoundError(f"The lora adapter '{name}' cannot be found.")
            self._dynamic.discard(name)
            if self._by_path.get(req.lora_path) is req:
                del self._by_path[req.lora_path]
            return req

    def resolve(self, model: str, *, hold: bool = False) -> LoRARequest:
        """The adapter a request's ``model`` names (registered, or a path under a root).
        ``hold``: also ``acquire`` it, in the same step as finding or registering it (so no
        other request's eviction comes in between); the caller then owes one ``release``."""
        with self._lock:
            req = self._by_name.get(model)
            if req is not None:
                return self._found(req, hold)
        if len(model) > MAX_MODEL_LEN:
            raise LoRANotFoundError(f"'{model[:64]}...' is longer than {MAX_MODEL_LEN} "
                                    "characters")
        real = self.resolve_path(model)
        with self._lock:
            req = self._by_path.get(real)
            if req is not None:
                return self._found(req, hold)
        try:
            validate_dir(real, self.max_rank, self.base)
        except FileNotFoundError:
            raise LoRANotFoundError(f"no LoRA adapter at '{model}'") from None
        with self._lock:
            req = self._by_path.get(real)  # registered by another thread meanwhile
            return self._found(req if req is not None else self._add_by_path(real), hold)

    def _found(self, req: LoRARequest, hold: bool) -> LoRARequest:
        if self._by_path.get(req.lora_path) is req:
            self._by_path.move_to_end(req.lora_path)
        if hold:
            self.acquire(req)
        return req

    def _add_by_path(self, real: str) -> LoRARequest:
        self._make_room()
        root = next(r for r in self.roots if os.path.commonpath([real, r]) == r)
        name = base = os.path.relpath(real, root)
        suffix = 1
        while name in self._by_name:  # a registered name that means another adapter
            suffix += 1
            name = f"{base}@{suffix}"
        req = self._register(name, real)
        self._by_path[real] = req
        return req

    def resolve_path(self, path: str) -> str:
        """``path`` resolved inside a ``--lora_root``; LoRANotFoundError otherwise."""
        if not self.roots:
            raise LoRANotFoundError(f"'{path}' is not a registered adapter, and loading "
                                    "adapters by path needs --lora_root")
        if "\x00" in path:
            raise LoRANotFoundError(f"no LoRA adapter at '{path}'")
        path = os.path.expanduser(path)  # still checked against the roots below
        candidates = [path] if os.path.isabs(path) else [os.path.join(r, path)
                                                         for r in self.roots]
        for candidate in candidates:
            real = os.path.realpath(candidate)
            if any(os.path.commonpath([real, root]) == root for root in self.roots) \
                    and os.path.isdir(real):
                return real
        raise LoRANotFoundError(f"no LoRA adapter at '{path}' under the --lora_root "
                                "directories")
