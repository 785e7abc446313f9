"""/openapi.json with the request bodies: the routes read their bodies themselves (bounded and
parsed off the event loop, ``body_bounds.py``), so FastAPI cannot see their models; this adds
each one's JSON schema, for clients, code generators and fuzzers."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


def declare_request_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """``bodies``: POST path -> the request model its handler parses."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = build()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in bodies.items():
            operation = schema.get("paths", {}).get(path, {}).get("post")
            if operation is None:
                continue
            model_schema = model.model_json_schema(ref_template=_REF)
            components.update(model_schema.pop("$defs", {}))
            components[model.__name__] = model_schema
            operation["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": _REF.format(model=model.__name__)}}}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
