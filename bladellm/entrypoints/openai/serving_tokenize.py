"""POST /tokenize and /detokenize with vLLM's request and response bodies.

/tokenize takes either ``{"prompt": str}`` or ``{"messages": [...]}`` (rendered with the chat
template exactly as /v1/chat/completions would) and answers ``{"count", "max_model_len",
"tokens", "token_strs"}``; /detokenize takes ``{"tokens": [...]}`` and answers
``{"prompt": str}``. Both run their CPU work in the tokenizer thread, off the event loop.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from bladellm.engine.prompt_limits import check_prompt_chars
from bladellm.http.errors import bad_request, unsupported
from bladellm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from bladellm.entrypoints.openai.serving_chat import chat_prompt_ids
from bladellm.engine.input_processor import check_token_ids
from bladellm.entrypoints.openai.serving_common import ServingContext


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for prompt, False for messages
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


async def tokenize(req: TokenizeRequest, raw: Request, ctx: ServingContext) -> Response:
    await ctx.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("exactly one of prompt and messages must be given", "prompt")
    if req.prompt is not None:
        check_prompt_chars(req.prompt, ctx.max_prompt_chars, ctx.max_model_len)
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = await ctx.offload.run(ctx.tokenizer.encode, req.prompt,
                                    add_special_tokens=add_special)
    else:
        if req.add_special_tokens:  # the template writes the special tokens itself
            raise unsupported("add_special_tokens", "add_special_tokens with messages")
        chat = ChatCompletionRequest(
            model=req.model, messages=req.messages or [],
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, chat_template=req.chat_template,
            chat_template_kwargs=req.chat_template_kwargs)
        if not chat.messages:
            raise bad_request("messages: must contain at least one message", "messages")
        ids, _ = await ctx.offload.run(chat_prompt_ids, chat, ctx)  # (ids, rendered text)
    ids = list(ids)
    strs = None
    if req.return_token_strs:
        strs = await ctx.offload.run(ctx.tokenizer.convert_ids_to_tokens, ids)
    return _json(TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids,
                                  token_strs=strs))


async def detokenize(req: DetokenizeRequest, raw: Request, ctx: ServingContext) -> Response:
    await ctx.check_model(req.model)
    check_token_ids(req.tokens, ctx.vocab_size, "tokens")
    text = await ctx.offload.run(ctx.tokenizer.decode, req.tokens)
    return _json(DetokenizeResponse(prompt=text))
