"""API-process side of admission: chat template, tokenization and request validation.

Everything a user can get wrong about a prompt is rejected here with a ``ValueError`` (HTTP 400)
before the request reaches the engine core, for the offline API and the servers alike (they
check only the shape of their own request bodies): token ids, lengths, chat messages. The core
trusts what it receives.

Fan-out of ``n > 1``: the core knows nothing about parallel samples. A request with ``n`` samples
becomes ``n`` independent child requests with ids ``f"{request_id}-{i}"`` (``n == 1`` keeps the
id unchanged) and ``n=1``; with a seed, child ``i`` samples with ``seed + i`` so children differ
but stay reproducible. The prompt cache shares the prompt's KV blocks between the children.
``OutputProcessor`` fans their outputs back in. Callers must use request ids that cannot collide
with another request's child ids (e.g. uuids).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

from bladellm.config import MultiModalConfig
from bladellm.errors import ContextLengthError
from bladellm.engine.messages import EngineCoreRequest
from bladellm.engine.model_info import ModelInfo
from bladellm.lora.request import LoRARequest
from bladellm.engine.prompt_limits import check_prompt_chars, prompt_char_limit
from bladellm.multimodal.inputs import MultiModalItem
from bladellm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_CHAT_ROLES = ("system", "user", "assistant", "tool")
_INT64_SPAN = 2**64
_INT64_MIN, _INT64_MAX = -2**63, 2**63 - 1


def child_request_ids(request_id: str, n: int) -> list[str]:
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


class InputProcessor:
    def __init__(self, model_info: ModelInfo, max_grammar_size: int | None = None,
                 priority_scheduling: bool = False,
                 mm_config: MultiModalConfig | None = None) -> None:
        self.model_info = model_info
        self.mm_config = mm_config or MultiModalConfig()
        # A vision-language model's image processor and placeholder (None: text only).
        self.images = _image_processor(model_info, self.mm_config)
        self.priority_scheduling = priority_scheduling  # --scheduling_policy priority
        self.tokenizer = model_info.tokenizer
        self._max_grammar_size = max_grammar_size
        self._grammar_validator = None  # built on the first constrained request
        self._grammar_validator_lock = threading.Lock()
        # Refuse hopeless prompts by length before paying for tokenization.
        self.max_prompt_chars = prompt_char_limit(self.tokenizer, model_info.max_model_len)
        self._tools_checked: set[str] = set()  # chat templates already checked for `tools`

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                arrival_time: float, *, add_special_tokens: bool = True,
                lora_request: LoRARequest | None = None,
                validate_grammar: bool = True, priority: int = 0,
                images: list[Any] | None = None) -> list[EngineCoreRequest]:
        """Tokenize and validate one request; returns one EngineCoreRequest per sample.

        ``add_special_tokens=False`` is for text that already carries them (a chat template's
        output usually starts with BOS). ``validate_grammar=False`` leaves the constraint's
        check (up to seconds for a huge ``guided_choice``) to the caller, which runs
        ``validate_grammar`` elsewhere (``AsyncLLM``: in its own thread pool, not in the
        tokenizer's queue). ``images``: PIL images, the i-th for the prompt's i-th image
        placeholder (``multi_modal_data``; the chat API's image parts).
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params: must be a SamplingParams, "
                            f"got {type(params).__name__}")
        check_priority(priority, self.priority_scheduling)
        prompt_token_ids = self.tokenize(prompt, add_special_tokens)
        mm_items: list[MultiModalItem] = []
        if images and self.images is None:
            raise ValueError(f"multi_modal_data: {self.model_info.served_model_name!r} is "
                             f"a text-only model; images are not supported")
        if self.images is not None:  # also refuses image placeholders without their images
            prompt_token_ids, mm_items = self.images.process(prompt_token_ids, images or [])
        info = self.model_info
        check_request(prompt_token_ids, params, info.vocab_size, info.max_model_len)
        if validate_grammar and params.guided_decoding is not None:
            self.validate_grammar(params)
        if params.n == 1:
            return [EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                      sampling_params=params, arrival_time=arrival_time,
                                      lora_request=lora_request, priority=priority,
                                      mm_items=mm_items)]
        return [
            EngineCoreRequest(request_id=child_id, prompt_token_ids=prompt_token_ids,
                              sampling_params=_child_params(params, i),
                              arrival_time=arrival_time, lora_request=lora_request,
                              priority=priority, mm_items=mm_items)
            for i, child_id in enumerate(child_request_ids(request_id, params.n))
        ]

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True,
                 param: str = "prompt") -> list[int]:
        """Token ids of a text prompt (refused first when it cannot fit by its length in
        characters; ``param``: the request field to name, e.g. "messages" for a rendered chat),
        or a token-id prompt as it is (checked by ``process``)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"{param}: must not be empty")
            check_prompt_chars(prompt, self.max_prompt_chars, self.model_info.max_model_len,
                               param)
            return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"prompt: must be a string or a list of token ids, "
                             f"got {type(prompt).__name__}")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
            raise ValueError("prompt: token ids must be integers")
        return list(prompt)

    def validate_grammar(self, params: SamplingParams) -> None:
        """A constraint llguidance rejects is a ValueError (HTTP 400) naming the field, before
        the request reaches the engine; constraints already seen valid are not checked again.
        Thread-safe: several validations may run at once (llguidance drops the GIL)."""
        if params.guided_decoding is None:
            return
        with self._grammar_validator_lock:
            if self._grammar_validator is None:
                from bladellm.guided.backend import GrammarLimits, GrammarValidator

                limits = (GrammarLimits() if self._max_grammar_size is None
                          else GrammarLimits(max_grammar_size=self._max_grammar_size))
                self._grammar_validator = GrammarValidator(limits=limits)
            validator = self._grammar_validator
        validator.validate(params.guided_decoding)

    def _warn_if_tools_unrendered(self, template: str | None) -> None:
        """Once per template: a request's tools that the template cannot show the model."""
        template = template or getattr(self.tokenizer, "chat_template", None)
        if not isinstance(template, str) or template in self._tools_checked:
            return
        self._tools_checked.add(template)
        if not template_uses_tools(template):
            logger.warning("a request sent tools, but the chat template of %r ignores them: the "
                           "model never sees the tools and will not call them (pass a template "
                           "that renders `tools` with --chat_template)",
                           self.model_info.served_model_name)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render OpenAI-style chat messages to prompt text with the tokenizer's template.

        Content given as a list of ``{"type": "text", "text": ...}`` parts is joined with
        newlines, since most templates expect a string. Extra ``kwargs`` (tools, a different
        ``chat_template``, template variables) go to ``tokenizer.apply_chat_template``.
        """
        if not self.model_info.has_chat_template and "chat_template" not in kwargs:
            raise ValueError(f"the tokenizer of {self.model_info.served_model_name!r} has no "
                             f"chat template; use the completions API or pass a chat template")
        placeholder = self.images.placeholder_text if self.images is not None else None
        conversation = normalize_messages(messages, placeholder)
        if kwargs.get("tools"):
            self._warn_if_tools_unrendered(kwargs.get("chat_template"))
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                **kwargs)
        except Exception as e:  # jinja2 TemplateError, raise_exception() inside templates
            raise ValueError(f"messages: chat template failed: {e}") from e
        return text

    def load_chat_images(self, messages: Any) -> list[Any]:
        """The images of the messages' ``image_url`` parts, in order (``load_images``), each
        failure naming ``messages[i].content[j]``."""
        return self.load_images([(param, _image_url(part))
                                 for param, part in _image_parts(messages)])

    def load_images(self, parts: list[tuple[str, Any]]) -> list[Any]:
        """One image per ``(param, url)``, in prompt order: a request's image parts, whatever
        its API (chat's ``image_url``, Responses' ``input_image``, Anthropic's ``image``
        blocks as data: URLs), decoded within the ``--limit_mm_per_prompt`` /
        ``--max_image_pixels`` / ``--max_image_bytes`` limits and the URL-fetch rule
        (``multimodal/image.py``); each failure is a ``MessageError`` naming its ``param``.
        Blocking (decoding, maybe fetching): call it off the event loop."""
        from bladellm.multimodal.image import ImageError, load_image_url

        images = []
        for n, (param, url) in enumerate(parts):
            if self.images is None:
                raise MessageError(f"{param}: {self.model_info.served_model_name!r} is a "
                                   f"text-only model; images are not supported", param,
                                   "unsupported_parameter")
            limit = self.mm_config.image_limit
            if n >= limit:
                raise MessageError(f"{param}: more than {limit} images in one request "
                                   f"(--limit_mm_per_prompt image={limit})", param,
                                   "invalid_image")
            try:
                images.append(load_image_url(url, self.mm_config))
            except ImageError as e:
                raise MessageError(f"{param}: {e}", param, "invalid_image") from None
        return images


def _image_url(part: dict) -> Any:
    spec = part.get("image_url")
    return spec.get("url") if isinstance(spec, dict) else None


def _image_parts(messages: Any):
    """(``messages[i].content[j]``, part) for each ``image_url`` part."""
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") == "image_url":
                yield f"messages[{i}].content[{j}]", part


def _image_processor(model_info: ModelInfo, config: MultiModalConfig):
    from bladellm.multimodal.processor import ImageInputProcessor, is_multimodal

    hf_config = getattr(model_info, "hf_config", None)
    if hf_config is None or not is_multimodal(hf_config):
        return None
    return ImageInputProcessor(model_info.model_dir, model_info.hf_config,
                               model_info.tokenizer, config)


def check_priority(priority: Any, priority_scheduling: bool) -> None:
    """A request's ``priority`` is an integer (int64: it crosses the process boundary), and one
    other than 0 needs ``--scheduling_policy priority``: under fcfs it would be accepted and
    ignored (vLLM refuses it too)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority: must be an integer, got {type(priority).__name__}")
    if not _INT64_MIN <= priority <= _INT64_MAX:
        raise ValueError(f"priority: must fit in 64 bits, got {priority}")
    if priority != 0 and not priority_scheduling:
        raise ValueError(f"priority: got {priority}, but this engine schedules first come, "
                         f"first served; a priority other than 0 needs --scheduling_policy "
                         f"priority")


def template_uses_tools(template: str) -> bool:
    """Whether a Jinja chat template reads its ``tools`` variable (one that does not renders
    the same prompt with or without tools: the model never learns of them)."""
    import jinja2
    from jinja2 import meta

    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        return True  # rendering will report it


def check_token_ids(ids: Iterable[int], vocab_size: int, param: str) -> None:
    """Every id a token the model has; else a ``ValueError`` naming ``param``."""
    for tok in ids:
        if not 0 <= int(tok) < vocab_size:
            raise ValueError(f"{param}: token id {tok} is out of range [0, {vocab_size}) "
                             f"(out of the vocabulary)")


def check_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int,
                  max_model_len: int) -> None:
    """A tokenized prompt and its parameters fit the model: ids in the vocabulary, prompt plus
    ``max_tokens`` within the context (``ContextLengthError``, which names the numbers)."""
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        raise ValueError("prompt: must not be empty (it tokenized to zero tokens)")
    check_token_ids(prompt_token_ids, vocab_size, "prompt")
    if num_prompt + (params.max_tokens or 1) > max_model_len:
        raise ContextLengthError(
            context_length_message(num_prompt, params.max_tokens, max_model_len),
            num_prompt_tokens=num_prompt, max_tokens=params.max_tokens,
            max_model_len=max_model_len)
    if num_prompt + params.min_tokens > max_model_len:
        # Without max_tokens (chat's default) the context is the cap: min_tokens beyond it can
        # never be met, so it is refused as completions refuse min_tokens > max_tokens.
        raise ValueError(f"min_tokens: prompt ({num_prompt} tokens) + min_tokens "
                         f"({params.min_tokens}) exceeds the model's maximum context length of "
                         f"{max_model_len} tokens")
    check_token_ids(params.stop_token_ids or (), vocab_size, "stop_token_ids")
    check_token_ids(params.logit_bias or {}, vocab_size, "logit_bias")


class MessageError(ValueError):
    """A chat message the server cannot render: ``param`` is the request field at fault and
    ``code`` OpenAI's error code for it (the servers answer 400 with both)."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code

    def __reduce__(self):  # crosses the offload thread / process boundaries intact
        return (MessageError, (str(self), self.param, self.code))


def context_length_message(num_prompt: int, max_tokens: int | None, max_model_len: int,
                           prompt: str = "prompt", max_tokens_name: str = "max_tokens") -> str:
    """Why a prompt (+ ``max_tokens``) does not fit; ``prompt`` / ``max_tokens_name``: the
    request fields to name (the chat API says ``messages``, maybe ``max_completion_tokens``)."""
    if max_tokens is None:
        return (f"{prompt} is {num_prompt} tokens, which leaves no room for output in the "
                f"model's maximum context length of {max_model_len} tokens")
    return (f"{prompt} ({num_prompt} tokens) + {max_tokens_name} ({max_tokens}) = "
            f"{num_prompt + max_tokens} tokens exceeds the model's maximum context length of "
            f"{max_model_len} tokens; shorten the {prompt} or lower {max_tokens_name}")


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    changes: dict = {"n": 1}
    if index > 0 and params.prompt_logprobs is not None:
        # The parent shows one set (the first child's): the others need not compute them, and
        # so keep their prompt-cache hits.
        changes["prompt_logprobs"] = None
    if params.seed is not None:
        # Wrap into int64 so seed + i stays a valid seed at the top of the range.
        changes["seed"] = (params.seed + index + 2**63) % _INT64_SPAN - 2**63
    return params.clone(**changes)


def normalize_messages(messages: Any, image_placeholder: str | None = None) -> list[dict]:
    """OpenAI-style messages as chat templates take them: known roles, content as text (an
    ``image_url`` part becomes ``image_placeholder``: a vision-language model's image token)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: must be a non-empty list")
    conversation = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}]: must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in _CHAT_ROLES:
            raise ValueError(f"messages[{i}].role: must be one of {list(_CHAT_ROLES)}, "
                             f"got {role!r}")
        normalized = dict(message)
        normalized["content"] = _content_text(message.get("content"), role, i,
                                              image_placeholder)
        conversation.append(normalized)
    return conversation


def _content_text(content: Any, role: str, i: int, image_placeholder: str | None = None) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":  # an assistant turn that only calls tools
        return ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url" and image_placeholder is not None:
                texts.append(image_placeholder)
                continue
            if kind == "image_url":
                raise MessageError(f"messages[{i}].content[{j}]: this is a text-only model; "
                                   f"images are not supported", f"messages[{i}].content[{j}]",
                                   "unsupported_parameter")
            if kind != "text":
                raise MessageError(f"content part of type '{kind}' is not supported by this "
                                   f"server; only {{'type': 'text', 'text': str}} parts are",
                                   f"messages[{i}].content", "unsupported_parameter")
            if not isinstance(part.get("text"), str):
                raise MessageError(f"messages[{i}].content[{j}]: a part of type 'text' must "
                                   f"have a 'text' string", f"messages[{i}].content[{j}]",
                                   "missing_required_parameter")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(f"messages[{i}].content: must be a string or a list of text parts")
