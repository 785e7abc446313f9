"""POST /v1/embeddings in OpenAI's shape: ``input`` as a string, a list of strings, a token-id
list or a list of those; ``encoding_format`` float or base64 (little-endian float32, what the
official client asks for by default); ``dimensions`` for Matryoshka models; vLLM's
``truncate_prompt_tokens``."""

from __future__ import annotations

import base64
import struct
from typing import Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from bladellm.http.errors import bad_request
from bladellm.entrypoints.openai.protocol import Int32, Int64
from bladellm.entrypoints.openai.serving_common import ServingContext, until_disconnect

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[str] | list[Int64] | list[list[Int64]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int32 | None = None
    # vLLM's extension: keep the last k tokens of each input (-1: the model's context length).
    truncate_prompt_tokens: Int32 | None = None
    user: str | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def _inputs(req: EmbeddingRequest) -> list[str | list[int]]:
    value = req.input
    if isinstance(value, str):
        if not value:  # the engine would say "prompt", a field this API does not have
            raise bad_request("input: must not be empty", "input")
        return [value]
    if not value:
        raise bad_request("input: must not be empty", "input")
    if isinstance(value[0], int):
        return [list(value)]  # type: ignore[arg-type]
    if len(value) > MAX_INPUTS:
        raise bad_request(f"input: at most {MAX_INPUTS} inputs per request", "input")
    for i, one in enumerate(value):
        if not one:
            raise bad_request(f"input[{i}]: must not be empty", "input")
    return list(value)  # type: ignore[arg-type]


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


async def create_embedding(req: EmbeddingRequest, raw: Request,
                           ctx: ServingContext) -> Response:
    if await ctx.check_model(req.model) is not None:
        # The embedding path has no adapter delta: the base model's vectors would be returned
        # under the adapter's name.
        raise bad_request("model: embeddings with a LoRA adapter are not supported; use the "
                          f"base model `{ctx.model_name}`", "model", code="unsupported_parameter")
    inputs = _inputs(req)
    try:
        outs = await until_disconnect(
            ctx.engine.embed(inputs, req.dimensions, req.truncate_prompt_tokens), raw)
    except ValueError as exc:
        if str(exc).startswith("input["):  # the engine's per-input checks (too long, bad id)
            raise bad_request(str(exc), "input") from None
        raise
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    response = EmbeddingResponse(
        model=ctx.model_name, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
        data=[EmbeddingData(index=i, embedding=_encode(o.embedding, req.encoding_format))
              for i, o in enumerate(outs)])
    return Response(response.model_dump_json(), media_type="application/json")
