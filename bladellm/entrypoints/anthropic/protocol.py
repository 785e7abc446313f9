"""Request and response bodies of Anthropic's Messages API (pydantic v2).

Requests forbid unknown fields, as Anthropic's API does. Fields the API defines for hosted
features this server cannot provide (server tools, containers, MCP servers, effort levels) are
not declared, so setting one is a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from bladellm.entrypoints.openai.protocol import Int32, Number

# ----------------------------------------------------------------------------------- requests


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(_Request):
    """A prompt-caching breakpoint. Accepted: the server caches every prompt prefix by itself
    (its prefix cache), so a breakpoint changes nothing."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Request):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None  # echoed back by clients; this server makes none


class Base64ImageSource(_Request):
    type: Literal["base64"]
    media_type: str  # checked in convert.py, so that a wrong one is a 400 naming the block
    data: str


class URLImageSource(_Request):
    type: Literal["url"]
    url: str


class FileImageSource(_Request):
    """A Files API id: declared so that it gets a 400 naming the block (no Files API here)."""

    type: Literal["file"]
    file_id: str


ImageSource = Annotated[Union[Base64ImageSource, URLImageSource, FileImageSource],
                        Field(discriminator="type")]


class ImageBlock(_Request):
    type: Literal["image"]
    source: ImageSource
    cache_control: CacheControl | None = None
    transformations: dict[str, Any] | None = None  # refused unless empty (convert.py)


class ToolUseBlock(_Request):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


def _str_or_list(value: Any) -> str:
    return "str" if isinstance(value, str) else "list"


ToolResultPart = Annotated[Union[TextBlock, ImageBlock], Field(discriminator="type")]


class ToolResultBlock(_Request):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Annotated[Union[Annotated[str, Tag("str")],
                             Annotated[list[ToolResultPart], Tag("list")]],
                       Discriminator(_str_or_list)] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(_Request):
    """A previous turn's thinking; not shown to the model again (Anthropic's API also drops
    earlier turns' thinking from the context)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Request):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock,
          RedactedThinkingBlock],
    Field(discriminator="type")]


class InputMessage(_Request):
    role: Literal["user", "assistant"]
    content: Annotated[Union[Annotated[str, Tag("str")],
                             Annotated[list[ContentBlock], Tag("list")]],
                       Discriminator(_str_or_list)]


class Tool(_Request):
    """A client tool (Anthropic's "custom" tool). Server tools (web search, code execution,
    ...) run on Anthropic's side and are refused."""

    name: str = Field(min_length=1, max_length=128, pattern=r"^[a-zA-Z0-9_-]+$")
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    strict: bool | None = None  # true: the input follows the schema (forced choices only)
    cache_control: CacheControl | None = None


class ToolChoiceAuto(_Request):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(_Request):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(_Request):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(_Request):
    type: Literal["none"]


ToolChoice = Annotated[Union[ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool, ToolChoiceNone],
                       Field(discriminator="type")]


class ThinkingEnabled(_Request):
    type: Literal["enabled"]
    # Anthropic's rule (>= 1024, < max_tokens). Not enforced during generation: like
    # Anthropic's own recent models, the budget guides the model and max_tokens bounds it.
    budget_tokens: Annotated[Int32, Field(ge=1024)]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingAdaptive(_Request):
    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(_Request):
    type: Literal["disabled"]


Thinking = Annotated[Union[ThinkingEnabled, ThinkingAdaptive, ThinkingDisabled],
                     Field(discriminator="type")]


class Metadata(_Request):
    user_id: str | None = Field(default=None, max_length=256)  # no effect on generation


class JSONOutputFormat(_Request):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Request):
    format: JSONOutputFormat | None = None


class _PromptRequest(_Request):
    """What /v1/messages and /v1/messages/count_tokens share: everything that makes the
    prompt."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: Annotated[Union[Annotated[str, Tag("str")],
                            Annotated[list[TextBlock], Tag("list")]],
                      Discriminator(_str_or_list)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None  # structured output: a JSON schema
    cache_control: CacheControl | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _client_tools_only(cls, tools: Any) -> Any:
        for i, tool in enumerate(tools if isinstance(tools, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind not in (None, "custom"):
                raise ValueError(f"tools[{i}] is the server tool {kind!r}, which this server "
                                 f"cannot run; only client tools (name, input_schema) are "
                                 f"supported")
        return tools


class MessagesRequest(_PromptRequest):
    max_tokens: Annotated[Int32, Field(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: Annotated[Number, Field(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[Int32, Field(ge=1)] | None = None
    top_p: Annotated[Number, Field(gt=0.0, le=1.0)] | None = None
    metadata: Metadata | None = None
    stream: bool = False
    # One tier here: both values mean "the standard one".
    service_tier: Literal["auto", "standard_only"] | None = None


class CountTokensRequest(_PromptRequest):
    pass


# ---------------------------------------------------------------------------------- responses


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextOut(_Response):
    type: Literal["text"] = "text"
    text: str


class ThinkingOut(_Response):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str


class ToolUseOut(_Response):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class Usage(_Response):
    """``input_tokens`` excludes the prompt tokens read from the prefix cache, which are
    ``cache_read_input_tokens`` (Anthropic's split: the prompt is their sum)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use",
                     "model_context_window_exceeded"]


class MessageResponse(_Response):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[Union[ThinkingOut, TextOut, ToolUseOut]]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(_Response):
    input_tokens: int
