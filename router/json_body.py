"""A route's JSON body, parsed and validated on a thread.

FastAPI parses and validates a body model on the event loop. For a big body that is
long: a 7 MB chat of 100k short messages took 2.6 s of pydantic's validation, and every
stream and health answer of the router waited for it. Routes take their body through
``Body[Model]`` (``json_body(Model)``) instead: the same steps (``json.loads``, then
``Model.model_validate``), with the same errors (``RequestValidationError``, locations
under ``"body"``), on a worker thread. Validation lets the loop run between its values;
``json.loads`` holds the GIL while it parses (0.4 s for those 7 MB, the bound that is left;
``router.max_request_bytes`` caps it). A body of at most ``INLINE_BYTES`` is read on the
loop (a few milliseconds at worst): sent to the shared thread pool, a small request
queued behind big ones there (a tiny /tokenize took 4.9 s behind eight 1.3 MB chats).
``document_bodies`` puts the body models back into ``/openapi.json``, which documents
a dependency's parameters only.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, Any, Generic, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema

Model = TypeVar("Model", bound=BaseModel)

# Bodies up to this size are parsed on the event loop (a 16 KiB list of tiny messages
# validates in ~6 ms; bigger ones go to a thread).
INLINE_BYTES = 16 << 10

if TYPE_CHECKING:
    Body = Annotated[Model, "a JSON body"]
else:

    class Body:
        """``Body[Model]``: a route parameter read as ``Model`` by ``json_body``."""

        def __class_getitem__(cls, model: type[BaseModel]) -> Any:
            return Annotated[model, Depends(json_body(model))]


class _BodyReader(Generic[Model]):
    def __init__(self, model: type[Model]) -> None:
        self.model = model

    async def __call__(self, request: Request) -> Model:
        body = await request.body()
        if len(body) <= INLINE_BYTES:
            return parse_body(self.model, body)
        return await asyncio.to_thread(parse_body, self.model, body)


def json_body(model: type[Model]) -> Callable[[Request], Awaitable[Model]]:
    """A dependency that reads the request's body as ``model``
    (``Annotated[Model, Depends(json_body(Model))]``)."""
    return _BodyReader(model)


def document_bodies(app: FastAPI) -> None:
    """``app``'s OpenAPI document with each ``Body[Model]`` route's request body (FastAPI
    lists a dependency's own parameters, not what it reads)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = get_openapi(title=app.title, version=app.version, routes=app.routes)
        bodies = [
            (route, dependency.call.model)
            for route in app.routes
            if isinstance(route, APIRoute)
            for dependency in route.dependant.dependencies
            if isinstance(dependency.call, _BodyReader)
        ]
        refs, schemas = models_json_schema(
            [(model, "validation") for model in {model for _, model in bodies}],
            ref_template="#/components/schemas/{model}",
        )
        document.setdefault("components", {}).setdefault("schemas", {}).update(
            schemas.get("$defs", {})
        )
        for route, model in bodies:
            content = {"application/json": {"schema": refs[(model, "validation")]}}
            for method in route.methods:
                operation = document["paths"][route.path_format][method.lower()]
                operation["requestBody"] = {"content": content, "required": True}
        app.openapi_schema = document
        return document

    app.openapi = openapi  # type: ignore[method-assign]


def parse_body(model: type[Model], body: bytes) -> Model:
    """``body`` as ``model``, or the ``RequestValidationError`` FastAPI would raise."""
    if not body:
        raise RequestValidationError(
            [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
        )
    try:
        value: Any = json.loads(body)
    except json.JSONDecodeError as error:
        raise _not_json(error.msg, error.pos) from None
    except UnicodeDecodeError as error:  # (FastAPI answered "an error parsing the body")
        raise _not_json(f"not {error.encoding} text", error.start) from None
    except ValueError as error:  # an integer past Python's 4,300 digits (it was a 500)
        raise _not_json(str(error).split(";", 1)[0], 0) from None
    try:
        return model.model_validate(value)
    except ValidationError as error:
        errors = error.errors(include_url=False)
        raise RequestValidationError(
            [{**each, "loc": ("body", *each["loc"])} for each in errors]
        ) from None


def _not_json(reason: str, position: int) -> RequestValidationError:
    error = {"type": "json_invalid", "loc": ("body", position), "msg": "JSON decode error"}
    return RequestValidationError([{**error, "input": {}, "ctx": {"error": reason}}])
