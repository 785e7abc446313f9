"""LoRA adapters over HTTP: vLLM's ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` (same names, bodies and plain-text success replies), and the
adapter cards ``/v1/models`` lists after the base model (``parent`` = the base model)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict

from bladellm.http.errors import APIError
from bladellm.http.handlers import from_exception
from bladellm.entrypoints.openai.protocol import ModelCard
from bladellm.lora.registry import LoRANotFoundError


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


def not_found(exc: Exception, param: str) -> APIError:
    return APIError(404, str(exc), "invalid_request_error", param=param, code="model_not_found")


def adapter_cards(engine: Any, base_name: str, created: int,
                  max_model_len: int) -> list[ModelCard]:
    registry = getattr(engine, "lora_registry", None)
    if registry is None:
        return []
    # ``root`` is the adapter's name too: its directory on the server is not the client's
    # business (a path under --lora_root is named by its path relative to the root).
    return [ModelCard(id=a.lora_name, created=created, root=a.lora_name, parent=base_name,
                      max_model_len=max_model_len) for a in registry.adapters()]


def add_lora_routes(router: APIRouter, engine: Any) -> None:
    def registry() -> Any:
        reg = getattr(engine, "lora_registry", None)
        if reg is None:
            raise APIError(400, "LoRA is not enabled on this server (--enable_lora).",
                           "invalid_request_error", code="lora_not_enabled")
        # A `model` equal to the served name picks the base model: no adapter may take it.
        reg.base_name = engine.model_info.served_model_name
        return reg

    reg = getattr(engine, "lora_registry", None)
    if reg is not None and hasattr(reg, "set_base_name"):
        reg.set_base_name(engine.model_info.served_model_name)  # --lora_modules checked too

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        try:
            body = LoadLoRAAdapterRequest.model_validate_json(await request.body())
            registry().add(body.lora_name, body.lora_path, named=True)
        except LoRANotFoundError as exc:
            return not_found(exc, "lora_path").response()
        except Exception as exc:  # noqa: BLE001 - bad adapters are 400s, never 500s
            return from_exception(exc).response()
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        try:
            body = UnloadLoRAAdapterRequest.model_validate_json(await request.body())
            reg = registry()
            current = reg.get(body.lora_name)
            if current is None or (body.lora_int_id is not None
                                   and body.lora_int_id != current.lora_int_id):
                raise LoRANotFoundError(f"The lora adapter '{body.lora_name}' cannot be found.")
            await engine.remove_lora(body.lora_name)
        except LoRANotFoundError as exc:
            return not_found(exc, "lora_name").response()
        except Exception as exc:  # noqa: BLE001
            return from_exception(exc).response()
        return PlainTextResponse(
            f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
