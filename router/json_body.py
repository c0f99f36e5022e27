"""A route's JSON body, parsed and validated on a thread.

FastAPI parses and validates a body model on the event loop. For a big body that is
long: a 7 MB chat of 100k short messages took 2.6 s of pydantic's validation, and every
stream and health answer of the router waited for it. Routes take their body through
``Body[Model]`` (``json_body(Model)``) instead: the same steps (``json.loads``, then
``Model.model_validate``), with the same errors (``RequestValidationError``, locations
under ``"body"``), on a worker thread. Validation lets the loop run between its values;
``json.loads`` holds the GIL while it parses (0.4 s for those 7 MB, the bound that is left;
``router.max_request_bytes`` caps it).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

Model = TypeVar("Model", bound=BaseModel)

if TYPE_CHECKING:
    Body = Annotated[Model, "a JSON body"]
else:

    class Body:
        """``Body[Model]``: a route parameter read as ``Model`` by ``json_body``."""

        def __class_getitem__(cls, model: type[BaseModel]) -> Any:
            return Annotated[model, Depends(json_body(model))]


def json_body(model: type[Model]) -> Callable[[Request], Awaitable[Model]]:
    """A dependency that reads the request's body as ``model``
    (``Annotated[Model, Depends(json_body(Model))]``)."""

    async def read(request: Request) -> Model:
        return await asyncio.to_thread(parse_body, model, await request.body())

    return read


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
        raise _not_json(str(error), 0) from None
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
