"""How a chat request's template options reach ``apply_chat_template``.

``chat_template_kwargs`` are template variables. Keys that are parameters of the rendering call
itself would collide with the ones the server passes (a ``TypeError`` and a 500 before), so:
``add_generation_prompt`` and ``continue_final_message`` are merged (the kwargs value wins, as in
vLLM); every other parameter name (``conversation``, ``messages``, ``tokenize``, ``tools``, ...)
is refused with a 400 naming it. A template sent with the request (``chat_template`` or
``chat_template_kwargs.chat_template``) runs user-written Jinja in the API process, so it is
refused unless the server runs with ``--trust_request_chat_template`` (vLLM's rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bladellm.http.errors import APIError, bad_request

MERGED = ("add_generation_prompt", "continue_final_message")
# Parameters of transformers' apply_chat_template and of InputProcessor.apply_chat_template.
RESERVED = frozenset({"conversation", "messages", "tools", "documents", "tokenize", "padding",
                      "truncation", "max_length", "return_tensors", "return_dict",
                      "return_assistant_tokens_mask", "tokenizer_kwargs", "kwargs", "self"})


@dataclass
class TemplateOptions:
    add_generation_prompt: bool
    continue_final_message: bool
    kwargs: dict[str, Any]  # template variables (+ chat_template when trusted)


def template_options(req: Any, trust_request_chat_template: bool) -> TemplateOptions:
    kwargs = dict(req.chat_template_kwargs or {})
    merged = {}
    for name in MERGED:
        value = kwargs.pop(name, getattr(req, name))
        if not isinstance(value, bool):
            raise bad_request(f"chat_template_kwargs.{name}: must be a boolean, got "
                              f"{type(value).__name__}", f"chat_template_kwargs.{name}")
        merged[name] = value
    for key in kwargs:
        if key in RESERVED:
            raise bad_request(f"chat_template_kwargs.{key}: '{key}' is set by the server and "
                              f"cannot be passed as a template variable",
                              f"chat_template_kwargs.{key}", code="reserved_parameter")
    template = kwargs.pop("chat_template", None)
    request_template = getattr(req, "chat_template", None)
    if template is not None and request_template is not None:
        raise bad_request("chat_template: given both as a field and in chat_template_kwargs",
                          "chat_template")
    template = template if template is not None else request_template
    if template is not None:
        if not trust_request_chat_template:
            raise APIError(400, "chat_template: a chat template sent with the request is not "
                                "allowed; start the server with --trust_request_chat_template "
                                "to accept one", "invalid_request_error",
                           param="chat_template", code="chat_template_not_allowed")
        if not isinstance(template, str) or not template:
            raise bad_request("chat_template: must be a non-empty string", "chat_template")
        kwargs["chat_template"] = template
    if merged["continue_final_message"] and merged["add_generation_prompt"]:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be "
                          "true", "continue_final_message")
    return TemplateOptions(merged["add_generation_prompt"], merged["continue_final_message"],
                           kwargs)
