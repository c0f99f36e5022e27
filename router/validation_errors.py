"""pydantic's validation errors as one 400 message: where in the body, and what was wrong.

pydantic reports a value that fits no member of a union once per member, each with the
member's tag in its location (``("messages", 0, "content", "list[ContentPart]", 0,
"image_url", "ImageUrl")``) and a message of its own ("Input should be a valid
string"). Passed on as they come, the first of them blames the wrong member and names no
place: a token id of ``1.5`` read "Input should be a valid string". This module keeps
the errors of the member that got furthest into the value (the one the client most
likely meant), names the place as a client writes it (``messages[0].content[0].image_url``),
and, when every error there is a wrong JSON type, says which types would do and which was
sent, as OpenAI does: ``input[0]: expected a string, an integer or a list, got a number``.
"""

from __future__ import annotations

from typing import Any

# pydantic's error types that mean "a value of another JSON type was wanted", as that type.
_WANTED = {
    "string_type": "a string",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "a boolean",
    "bool_parsing": "a boolean",
    "list_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}
_MISSING = "a required field is missing"
# The union tags pydantic gives its basic types (others hold "[", "-" or a class name).
_BASIC_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def describe(errors: list[dict[str, Any]], field_at: int = 0) -> tuple[str, str, str | None]:
    """``errors`` (pydantic's, of one value) as (place, message, top-level field): the
    place in the body the error is at, written as a client would (``""`` for a check of
    the whole body), what is wrong there, and the top-level field for the 400's
    ``param``. ``field_at`` is where the body's fields start in each location (FastAPI's
    start with "body"). A check of the whole body that raised a ``FieldError`` names its
    own field (its ``param``)."""
    if not errors:
        return "", "invalid request", None
    paths = [_path(error.get("loc", ())[field_at:]) for error in errors]
    deepest = max(paths, key=_progress)  # the member furthest into the value
    there = [error for error, path in zip(errors, paths, strict=True) if path == deepest]
    first = there[0]
    param = deepest[0] if deepest and isinstance(deepest[0], str) else None
    cause = first.get("ctx", {}).get("error")
    if param is None and getattr(cause, "param", None) is not None:
        param = cause.param
    wanted = list(dict.fromkeys(_WANTED.get(error.get("type", "")) for error in there))
    if None not in wanted:
        got = _json_type(first.get("input"))
        return _place(deepest), f"expected {_one_of(wanted)}, got {got}", param
    if first.get("type") == "missing":
        return _place(deepest), _MISSING, param
    return _place(deepest), first.get("msg", "invalid").removeprefix("Value error, "), param


def error_message(errors: list[dict[str, Any]], field_at: int = 0) -> tuple[str, str | None]:
    """``describe``'s place and message joined into one text, and the top-level field."""
    place, message, param = describe(errors, field_at)
    if not place:
        return message, param
    if message == _MISSING:
        return f"{place} is required", param
    return f"{place}: {message}", param


def _path(loc: tuple[Any, ...]) -> tuple[str | int, ...]:
    """A location without pydantic's union tags."""
    return tuple(part for part in loc if not _is_tag(part))


def _progress(path: tuple[str | int, ...]) -> tuple[int, tuple[int, ...]]:
    """How far into the value an error's path got: deeper, then further along a list
    (a list of ids that fails at item 3 got further than a list of texts failing at 0)."""
    return len(path), tuple(part if isinstance(part, int) else -1 for part in path)


def _is_tag(part: Any) -> bool:
    if not isinstance(part, str):
        return False
    return part in _BASIC_TAGS or "[" in part or "-" in part or part[:1].isupper()


def _place(path: tuple[str | int, ...]) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text


def _one_of(choices: list[str | None]) -> str:
    words = [choice for choice in choices if choice is not None]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _json_type(value: Any) -> str:
    """What JSON calls the type of ``value`` (a bool is not a number here)."""
    if value is None:
        return "null"
    for kind, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"),
                       (str, "a string"), (list, "a list"), (dict, "an object")):  # fmt: skip
        if isinstance(value, kind):
            return name
    return type(value).__name__
