"""Tool calling for /v1/chat/completions.

- ``tool_choice`` ``"required"`` or a named function forces a valid call through structured
  output: the named function's arguments follow its ``parameters`` schema; ``"required"`` makes
  the model write a JSON array of ``{"name", "parameters"}`` objects, one of the tools each.
- ``"auto"`` (the default when ``tools`` are given) parses calls out of free text, in the Hermes /
  Qwen2.5 format (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) and the Llama 3.x
  JSON format (``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``,
  several separated by ``;``). A call must name one of the request's tools; anything else stays
  text. ``"none"`` leaves the text alone.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from bladellm.http.errors import bad_request

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_ANY_OBJECT = {"type": "object"}


@dataclass
class ToolChoice:
    tools: list[dict[str, Any]]  # as the request gave them (also what the chat template gets)
    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the forced function (mode "named")
    parallel: bool = True  # False: at most one call ("required" is cut to one item)

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def parameters(self, name: str) -> dict[str, Any]:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or _ANY_OBJECT
        raise KeyError(name)


def parse_tool_choice(tools: list[Any] | None, tool_choice: Any,
                      parallel_tool_calls: bool | None = None) -> ToolChoice | None:
    """Validate ``tools`` / ``tool_choice``; None when no tools are involved."""
    choice = _parse_tool_choice(tools, tool_choice)
    if choice is not None and parallel_tool_calls is False:
        choice.parallel = False
    return choice


def _parse_tool_choice(tools: list[Any] | None, tool_choice: Any) -> ToolChoice | None:
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice: requires tools", "tool_choice")
        return None
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(tool, dict) or tool.get("type", "function") != "function"
                or not isinstance(fn, dict) or not isinstance(fn.get("name"), str)
                or not fn["name"]):
            raise bad_request(f"tools[{i}]: must be {{'type': 'function', 'function': "
                              f"{{'name': str, 'parameters': object}}}}", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_request(f"tools[{i}].function.parameters: must be a JSON schema object",
                              "tools")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", "tools")
    if tool_choice is None:
        return ToolChoice(tools, "auto")
    if tool_choice in ("none", "auto", "required"):
        return ToolChoice(tools, tool_choice)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in names:
            raise bad_request(f"tool_choice: function {name!r} is not among the tools "
                              f"{names}", "tool_choice")
        return ToolChoice(tools, "named", name)
    raise bad_request("tool_choice: must be 'none', 'auto', 'required' or "
                      "{'type': 'function', 'function': {'name': ...}}", "tool_choice")


def forced_constraint(choice: ToolChoice | None) -> tuple[str, dict[str, Any]] | None:
    """The JSON-schema constraint that forces a call, as (field name, constraint)."""
    if choice is None or choice.mode in ("none", "auto"):
        return None
    if choice.mode == "named":
        return "tool_choice", {"json": choice.parameters(choice.name)}  # type: ignore[arg-type]
    variants = [{"type": "object", "properties": {"name": {"const": name},
                                                   "parameters": choice.parameters(name)},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for name in choice.names]
    items = variants[0] if len(variants) == 1 else {"anyOf": variants}
    array = {"type": "array", "items": items, "minItems": 1}
    if not choice.parallel:
        array["maxItems"] = 1
    return "tool_choice", {"json": array}


def new_call(name: str, arguments: Any) -> dict[str, Any]:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def forced_calls(choice: ToolChoice, text: str) -> list[dict[str, Any]]:
    """Tool calls from the output of a forced call (``text`` is the constrained JSON)."""
    if choice.mode == "named":
        return [new_call(choice.name, text)]  # type: ignore[arg-type]
    try:
        calls = json.loads(text)
    except ValueError:
        return []  # cut by max_tokens: no complete call
    return [new_call(c["name"], c.get("parameters", {})) for c in calls]


def _as_call(obj: Any, names: list[str]) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
    elif not isinstance(args, dict):
        return None
    return new_call(obj["name"], args)


def _parse_hermes(text: str, names: list[str]) -> tuple[str | None, list[dict[str, Any]]]:
    calls, content, rest = [], [], text
    while HERMES_START in rest:
        before, _, after = rest.partition(HERMES_START)
        body, end, rest = after.partition(HERMES_END)
        try:
            call = _as_call(json.loads(body.strip()), names)
        except ValueError:
            call = None
        if call is None:
            return text, []  # not a well-formed call: all of it is text
        content.append(before)
        calls.append(call)
        if not end:
            break
    content.append(rest)
    joined = "".join(content).strip()
    return joined or None, calls


def _parse_llama_json(text: str, names: list[str]) -> tuple[str | None, list[dict[str, Any]]]:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return text, []
        call = _as_call(obj, names)
        if call is None:
            return text, []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return None, calls


def parse_auto(text: str, names: list[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of free text; no calls → (text, [])."""
    if HERMES_START in text:
        return _parse_hermes(text, names)
    stripped = text.lstrip()
    if stripped.startswith("{") or stripped.startswith(PYTHON_TAG):
        return _parse_llama_json(text, names)
    return text, []


@dataclass
class AutoToolStream:
    """Streams text as content until it may be a tool call; from there it holds the text back and
    parses it at the end."""

    names: list[str]
    text: str = ""
    sent: int = 0  # characters of ``text`` sent as content
    holding: bool = False
    calls: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, delta: str) -> str:
        """Content to send now."""
        self.text += delta
        if self.holding:
            return ""
        unsent = self.text[self.sent:]
        if self.sent == 0:  # Llama 3.x JSON calls start the output
            head = unsent.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                return ""  # may still become <|python_tag|>: wait for more text
            if head.startswith(("{", PYTHON_TAG)):
                self.holding = True
                return ""
        return self._hermes(unsent)

    def _hermes(self, unsent: str) -> str:
        start = unsent.find(HERMES_START)
        if start >= 0:
            self.holding = True
            self.sent += start
            return unsent[:start]
        # Keep back a suffix that could be the start of "<tool_call>".
        keep = next((k for k in range(min(len(HERMES_START) - 1, len(unsent)), 0, -1)
                     if HERMES_START.startswith(unsent[-k:])), 0)
        out = unsent[:len(unsent) - keep]
        self.sent += len(out)
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content still to send, tool calls) once the output is complete."""
        rest = self.text[self.sent:]
        if not self.holding:
            self.sent = len(self.text)
            return rest, []
        content, calls = parse_auto(self.text, self.names)
        if not calls:
            self.sent = len(self.text)
            return rest, []
        self.calls = calls
        # Hermes: text before the first call was already sent; text between/after calls is
        # dropped from the stream (the non-streaming answer keeps it as content).
        return "", calls
