"""The OpenAPI document: the handlers parse raw bodies (for our own error messages and the size bound), so
their request models and error responses are declared here instead of inferred from typed parameters."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"


def json_body(*models: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra`: a required JSON body that is one of `models`."""
    refs = [{"$ref": _REF.format(model=m.__name__)} for m in models]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install_openapi(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Serve an OpenAPI document whose components include the JSON schemas of the request `models`."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
