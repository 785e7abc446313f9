"""Steering for the schemathesis runs over /openapi.json (tests/unit/entrypoints/
test_openapi_fuzz.py in-process, tests/e2e/test_openapi_fuzz_live.py on a live server):
random ``model`` names and response ids stop almost every generated case at a 404, so three
cases in four are pointed at things that exist. The choice is a function of the case alone, so
that hypothesis can replay and shrink a failure."""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from typing import Any


def steer(case: Any, model: str, new_response_id: Callable[[], str],
          adapter_name: str | None = None, adapter_path: str | None = None) -> None:
    """Rewrite ``case`` (a ``schemathesis.Case``) in place: the served ``model`` (or, one time
    in four when given, ``adapter_name``), a fresh stored response's id for ``response_id``
    and ``previous_response_id``, ``adapter_path`` for ``lora_path``."""
    key = json.dumps([case.path_parameters, case.body], sort_keys=True, default=repr)
    pick = zlib.crc32(key.encode()) % 4
    if pick == 0:
        return  # as generated
    name = adapter_name if pick == 3 and adapter_name else model
    params = case.path_parameters or {}
    if "response_id" in params:
        params["response_id"] = new_response_id()
    if "model_id" in params:
        params["model_id"] = name
    body = case.body
    if not isinstance(body, dict):
        return
    if "model" in body:
        body["model"] = name
    if isinstance(body.get("previous_response_id"), str):
        body["previous_response_id"] = new_response_id()
    if "lora_path" in body and adapter_path:
        body["lora_path"] = adapter_path
    if "lora_name" in body and pick == 2 and adapter_name:
        body["lora_name"] = adapter_name
