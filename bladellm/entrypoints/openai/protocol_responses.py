"""Request and response bodies of OpenAI's Responses API (``/v1/responses``), pydantic v2.

Field and event names follow the official ``openai`` package (``openai/types/responses``). The
request forbids unknown top-level fields, like the other endpoints; input items accept extra keys,
because clients send earlier ``response.output`` items back as input and those carry fields
(``status``, ``phase``, ...) that do not change the conversation. Those keys are dropped while
parsing: a stored response keeps only what the model reads, not whatever a client attached.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from bladellm.entrypoints.openai.protocol import Int32, Int64, Number


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Item(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# ----------------------------------------------------------------------------------- requests


class ContentPart(_Item):
    """``input_text`` / ``output_text`` (text), ``refusal``, ``input_image`` (``image_url``: a
    data: URL or an http(s) URL; ``file_id`` is refused); files are refused."""

    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None


class ReasoningContent(_Item):
    type: str
    text: str


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningContent] = Field(default_factory=list)
    content: list[ReasoningContent] | None = None
    encrypted_content: str | None = None


class ItemReference(_Item):
    type: Literal["item_reference"]
    id: str


def _item_tag(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "")
    return kind if isinstance(kind, str) else ""


InputItem = Annotated[
    Union[Annotated[MessageItem, Tag("message")],
          Annotated[FunctionCallItem, Tag("function_call")],
          Annotated[FunctionCallOutputItem, Tag("function_call_output")],
          Annotated[ReasoningItem, Tag("reasoning")],
          Annotated[ItemReference, Tag("item_reference")]],
    Discriminator(_item_tag)]


def _input_tag(value: Any) -> str:
    return "str" if isinstance(value, str) else "list"


class Tool(_Item):
    """A function tool (``{"type": "function", "name", "parameters", "strict", "description"}``);
    any other ``type`` is a hosted tool, refused by name in ``responses_input.py``."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Request):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # deprecated name


class ResponsesRequest(_Request):
    model: str | None = None
    input: Annotated[Union[Annotated[str, Tag("str")], Annotated[list[InputItem], Tag("list")]],
                     Discriminator(_input_tag)]
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: Int32 | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    include: list[str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    priority: Int64 = 0  # lower is served first (vLLM's convention)
    # Harmless OpenAI fields: accepted, with no effect on generation (as on chat).
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Declared but unsupported: a set value gets a 400 naming it.
    background: bool | None = None
    max_tool_calls: Int32 | None = None
    top_logprobs: Int32 | None = None
    conversation: Any = None
    prompt: Any = None


# ---------------------------------------------------------------------------------- responses


def _now() -> int:
    return int(time.time())


class OutputText(_Response):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(_Response):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallOutput(_Response):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(_Response):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOutput(_Response):
    """The model's thinking, in the clear (``content``); no summary, no encrypted copy."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = Union[OutputMessage, FunctionCallOutput, ReasoningOutput]


class InputTokensDetails(_Response):
    cached_tokens: int = 0


class OutputTokensDetails(_Response):
    reasoning_tokens: int = 0


class ResponseUsage(_Response):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class IncompleteDetails(_Response):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(_Response):
    code: str
    message: str


class ResponseObject(_Response):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=_now)
    completed_at: int | None = None
    status: Literal["completed", "failed", "in_progress", "cancelled", "queued",
                    "incomplete"] = "in_progress"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: Literal["disabled", "auto"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    background: bool = False
    priority: int = 0  # the request's scheduling priority (an extra, like vLLM's)


class DeletedResponse(_Response):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
