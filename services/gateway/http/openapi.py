"""Request bodies in /openapi.json.

The POST routes read the raw body and validate it with their pydantic model themselves
(parse_body: faster, and errors in OpenAI's shape), so FastAPI knows nothing of their
bodies. Each route declares its model with `openapi_extra=request_body(Model)`, and
add_request_schemas puts the models' JSON schemas (nested models included) under
components/schemas, where those references point.
"""

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF_TEMPLATE = "#/components/schemas/{model}"
_MODELS: dict[str, type[BaseModel]] = {}  # the models request_body has referenced


def request_body(model: type[BaseModel], required: bool = True) -> dict:
    """A route's `openapi_extra`: its JSON body is `model`."""
    _MODELS[model.__name__] = model
    return {"requestBody": {"required": required, "content": {"application/json": {
        "schema": {"$ref": REF_TEMPLATE.format(model=model.__name__)}}}}}


def add_request_schemas(app: FastAPI) -> None:
    """Makes app.openapi() add the referenced models' schemas to the document FastAPI builds."""
    build = app.openapi

    def openapi() -> dict:
        document = build()  # FastAPI builds it once, then returns the same dict
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        if not all(name in schemas for name in _MODELS):
            _, definitions = models_json_schema([(model, "validation") for model in _MODELS.values()],
                                                ref_template=REF_TEMPLATE)
            schemas.update(definitions.get("$defs", {}))
        return document

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the schema


def query_parameters(model: type[BaseModel]) -> dict:
    """A route's `openapi_extra`: its query parameters are `model`'s fields (vLLM's routes take their options so)."""
    schema = model.model_json_schema()
    required = set(schema.get("required", []))
    return {"parameters": [{"name": name, "in": "query", "required": name in required, "schema": field}
                           for name, field in schema["properties"].items()]}
