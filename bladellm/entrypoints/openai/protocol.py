"""Request and response bodies in OpenAI's shapes (pydantic v2).

Requests forbid unknown fields (OpenAI answers "Unrecognized request argument supplied"), and
fields that OpenAI or vLLM define but this server cannot honour are declared so that setting them
gets a 400 saying so rather than being silently ignored (see ``serving_common.reject_unsupported``).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, model_serializer

from bladellm.sampling_params import INT32_MAX, INT64_MAX, INT64_MIN


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


def _now() -> int:
    return int(time.time())


# ------------------------------------------------------------------- numbers at the boundary
# Every numeric request field takes one of these shapes: JSON numbers only (no "5", no true:
# strict), and only values the engine can hold (its per-row arrays are int32 / int64 / float32
# and msgspec carries at most 64 bits), so an out-of-range value is a 400 naming the field here,
# never an overflow inside a step shared with other requests. The meaning of a value (top_p in
# (0, 1], max_tokens >= 1, ...) is SamplingParams' check, which names the field too.

Int32 = Annotated[int, Strict(), Field(ge=-INT32_MAX - 1, le=INT32_MAX)]
Int64 = Annotated[int, Strict(), Field(ge=INT64_MIN, le=INT64_MAX)]
Number = Annotated[float, Strict(), Field(allow_inf_nan=False)]


# ----------------------------------------------------------------------------------- requests


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM extra: usage in every chunk


class ResponseFormat(_Request):
    model_config = ConfigDict(extra="allow")
    type: str


class SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: Int32 | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    n: Int32 = 1
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extras (vLLM spelling).
    top_k: Int32 | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Int64] | None = None
    min_tokens: Int32 = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0  # lower first; other than 0 needs --scheduling_policy priority
    # Structured output (docs/structured_output.md): at most one constraint per request.
    response_format: ResponseFormat | None = None
    guided_json: Any = None  # a JSON schema: an object or JSON text
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # only "llguidance"
    guided_whitespace_pattern: str | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's newer spelling of guided_*
    # Declared but unsupported: a set value gets a 400 naming it.
    best_of: Int32 | None = None
    use_beam_search: bool = False
    prompt_logprobs: Int32 | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[Int64] | list[list[Int64]]
    echo: bool = False
    logprobs: Int32 | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. "refusal": null echoed back by clients
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    # An earlier assistant turn's thinking (--reasoning_parser), under either name the server
    # sends it; the chat template gets it as reasoning_content.
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: Int32 | None = None
    max_completion_tokens: Int32 | None = None
    # Harmless OpenAI fields: accepted, with no effect on generation.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None  # false: at most one tool call
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Extras (vLLM spelling).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # refused unless --trust_request_chat_template
    # Tool calling (entrypoints/openai/tool_calls.py).
    tools: list[Any] | None = None
    tool_choice: Any = None
    # Declared but unsupported.
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: str | None = None
    web_search_options: Any = None


# ---------------------------------------------------------------------------------- responses


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class CompletionTokensDetails(_Response):
    reasoning_tokens: int = 0  # --reasoning_parser: tokens of the thinking, its tags included


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None  # only with reasoning

    @model_serializer(mode="wrap")
    def _drop_absent_details(self, handler):  # type: ignore[no-untyped-def]
        data = handler(self)
        if data.get("completion_tokens_details") is None:
            data.pop("completion_tokens_details", None)
        return data


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM extra: stop string or token id
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM extra


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str  # JSON text


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None  # omitted when the model called no tool
    # --reasoning_parser: the thinking, under both names clients read (vLLM's reasoning_content
    # and the newer reasoning); omitted by servers without a reasoning parser.
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_serializer(mode="wrap")
    def _drop_empty_tool_calls(self, handler):  # type: ignore[no-untyped-def]
        data = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM extra: stop string or token id


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class DeltaMessage(_Response):
    """A streamed delta carries only what changed: absent keys are omitted, as OpenAI does."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None  # --reasoning_parser: thinking text, also as reasoning
    reasoning: str | None = None
    # [{"index", "id", "type", "function": {"name", "arguments"}}]; later deltas of the same call
    # carry only "index" and more "arguments" text.
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):  # type: ignore[no-untyped-def]
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM extra: stop string or token id


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChunk(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "bladellm"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
