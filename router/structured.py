"""A request's structured-output constraint, from whichever field the client used.

Three spellings reach the same ``StructuredOutput`` (``common/structured_output.py``):

- OpenAI's ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``
  (any JSON object) or ``{"type": "json_schema", "json_schema": {"name": ...,
  "schema": {...}}}``;
- vLLM's ``structured_outputs`` object: one of ``json``, ``regex``, ``choice``,
  ``grammar`` or ``json_object: true``;
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``;
- vLLM's structural tag (``response_format`` type ``structural_tag``,
  ``structured_outputs.structural_tag`` or the top-level ``structural_tag``): free text in
  which each tagged segment, once a trigger starts it, must match its schema.

At most one constraint per request (vLLM's rule). The constraint is compiled here once,
against the checkpoint's tokenizer and up to its first mask as a worker would, so a bad
schema, regex or grammar is a 400 naming its field, not a worker error.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from common.structured_output import (
    JSON_OPTIONS,
    GrammarCompiler,
    StructuredOutput,
    StructuredOutputError,
    require_llguidance,
)
from router.protocol import FieldError

ANY_JSON_OBJECT = '{"type": "object"}'
# vLLM's structured_outputs options that change nothing here: JSON is already generated
# without optional whitespace, and there is one backend, with no fallback.
# (``disable_additional_properties`` is served: ``_without_additional_properties``.)
_NO_OP_OPTIONS = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties")


def _without_additional_properties(schema_text: str) -> str:
    """The schema with ``additionalProperties: false`` on every object schema that lists
    properties and says nothing of others: vLLM's ``disable_additional_properties`` for
    its llguidance backend (which follows JSON Schema's default, as llguidance here
    does), so objects hold only their declared keys, as xgrammar makes them. Accepted
    and ignored, it let a schema's objects take keys it never declared."""

    schema = json.loads(schema_text)
    stack = [schema]  # (a loop: a deep schema would pass the recursion limit)
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            listed = "properties" in node or "patternProperties" in node
            if listed and "additionalProperties" not in node:
                node["additionalProperties"] = False
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return json.dumps(schema)


def _json_text(value: Any, where: str) -> str:
    """A JSON schema given as an object or as JSON text, as JSON text. ``where`` names
    it (``structured_outputs.json``); the error's param is its top-level field."""
    param = where.split(".")[0]
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError as error:
            raise FieldError(f"{where} must be a JSON schema (an object, or its JSON text); "
                             f"the text given is not JSON: {error}", param) from error  # fmt: skip
        return value
    if not isinstance(value, dict):
        raise FieldError(f"{where} must be a JSON schema (an object)", param)
    return json.dumps(value)


def _from_response_format(value: dict[str, Any]) -> StructuredOutput | None:
    kind = value.get("type")
    if kind is None:  # (OpenAI's is required: a schema sent without it would go unenforced)
        raise FieldError("response_format.type is required (text, json_object, json_schema or "
                         "structural_tag)", "response_format")  # fmt: skip
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json", ANY_JSON_OBJECT)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or spec.get("schema") is None:
            raise FieldError(
                "response_format.json_schema.schema is required with type json_schema",
                "response_format",
            )
        schema = _json_text(spec["schema"], "response_format.json_schema.schema")
        return StructuredOutput("json", schema)
    if kind == "structural_tag":
        return _structural_tag(value, "response_format")
    raise FieldError(
        f"response_format type {kind!r} is not supported (text, json_object, json_schema or "
        "structural_tag)",
        "response_format",
    )


def _structural_tag(value: Any, where: str) -> StructuredOutput:
    """vLLM's structural tag in the form its llguidance backend serves: ``structures``
    (each a ``begin``, a JSON ``schema`` and an ``end``) and ``triggers``. The text is
    free until a trigger; a structure then runs from its ``begin`` (which starts with a
    trigger) through JSON matching its schema to its ``end``, and free text goes on.
    Given as an object or its JSON text; compiled as vLLM compiles it, into llguidance's
    ``StructTag`` grammar. xgrammar's newer ``format`` form is refused by name."""
    param = where.split(".")[0]
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            message = f"{where} must be a structural tag (an object, or its JSON text); "
            raise FieldError(message + f"the text given is not JSON: {error}", param) from error
    if not isinstance(value, dict):
        raise FieldError(f"{where} must be a structural tag object", param)
    if "format" in value:
        raise FieldError(f"{where}: the 'format' form of structural tags is not supported; "
                         "give 'structures' and 'triggers'", param)  # fmt: skip
    structures, triggers = value.get("structures"), value.get("triggers")
    if (
        not isinstance(triggers, list)
        or not triggers
        or not all(isinstance(t, str) and t for t in triggers)
    ):
        raise FieldError(f"{where}.triggers must be a non-empty list of non-empty strings", param)
    if not isinstance(structures, list) or not structures:
        raise FieldError(f"{where}.structures must be a non-empty list", param)
    llguidance = require_llguidance()
    tags = []
    for index, structure in enumerate(structures):
        at = f"{where}.structures[{index}]"
        if not isinstance(structure, dict):
            raise FieldError(f"{at} must be an object with begin, schema and end", param)
        begin, schema, end = structure.get("begin"), structure.get("schema"), structure.get("end")
        if not isinstance(begin, str) or not isinstance(end, str):
            raise FieldError(f"{at}.begin and .end must be strings", param)
        if isinstance(schema, str):  # its JSON text
            with contextlib.suppress(ValueError):
                schema = json.loads(schema)
        if schema is True:  # JSON Schema's "anything"
            schema = {}
        if not isinstance(schema, dict):
            raise FieldError(f"{at}.schema must be a JSON schema (an object, or its JSON "
                             "text)", param)  # fmt: skip
        schema = {"x-guidance": JSON_OPTIONS, **schema}  # JSON as every constraint writes it
        started = [t for t in triggers if begin.startswith(t)]
        if not started:
            raise FieldError(f"{at}.begin must start with one of the triggers", param)
        tags += [llguidance.StructTag(trigger=t, begin=begin, grammar=schema, end=end)
                 for t in started]  # fmt: skip
    return StructuredOutput("grammar", llguidance.StructTag.to_grammar(tags))


def _from_structured_outputs(value: dict[str, Any]) -> StructuredOutput | None:
    param = "structured_outputs"
    found: list[StructuredOutput] = []
    for key, item in value.items():
        if item is None or key in _NO_OP_OPTIONS or key == "backend":
            continue
        if key == "json":
            schema = _json_text(item, f"{param}.json")
            if value.get("disable_additional_properties") is True:
                schema = _without_additional_properties(schema)
            found.append(StructuredOutput("json", schema))
        elif key == "json_object":
            if item is not True:
                raise FieldError(f"{param}.json_object must be true when given", param)
            found.append(StructuredOutput("json", ANY_JSON_OBJECT))
        elif key in ("regex", "grammar"):
            if not isinstance(item, str) or not item:
                raise FieldError(f"{param}.{key} must be a non-empty string", param)
            found.append(StructuredOutput(key, item))
        elif key == "choice":
            found.append(_choice(item, f"{param}.choice"))
        elif key == "structural_tag":
            found.append(_structural_tag(item, f"{param}.structural_tag"))
        else:
            raise FieldError(f"{param}.{key} is not supported by this server", param)
    if len(found) > 1:
        raise FieldError(f"{param} may hold only one of json, regex, choice, grammar, "
                         "json_object, structural_tag", param)  # fmt: skip
    return found[0] if found else None


# A constraint's compile time grows faster than its size (a choice of 12,500 strings:
# 0.25 s; 50,000: 8 s; 100,000 in a 1.2 MB body: 35 s, on the router and again on every
# worker): bounded so that one request cannot hold compile threads for a minute. A JSON
# schema or grammar of a real application is far smaller.
MAX_CONSTRAINT_BYTES = 256 << 10


def _choice(value: Any, param: str) -> StructuredOutput:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise FieldError(f"{param} must be a non-empty list of strings", param.split(".")[0])
    return StructuredOutput("choice", json.dumps(value))


def structured_output_of(body: Any) -> tuple[str, StructuredOutput] | None:
    """The request's one constraint and the field it came in; None for free text. Raises
    ``FieldError`` naming the field at fault. Cheap: ``check`` compiles it."""
    found: list[tuple[str, StructuredOutput]] = []
    if body.response_format is not None:
        structured = _from_response_format(body.response_format)
        if structured is not None:
            found.append(("response_format", structured))
    if body.structured_outputs:
        structured = _from_structured_outputs(body.structured_outputs)
        if structured is not None:
            found.append(("structured_outputs", structured))
    if body.guided_json is not None:
        spec = _json_text(body.guided_json, "guided_json")
        found.append(("guided_json", StructuredOutput("json", spec)))
    for name, kind in (("guided_regex", "regex"), ("guided_grammar", "grammar")):
        value = getattr(body, name)
        if value is not None:
            if not value:
                raise FieldError(f"{name} must not be empty", name)
            found.append((name, StructuredOutput(kind, value)))
    if body.guided_choice is not None:
        found.append(("guided_choice", _choice(body.guided_choice, "guided_choice")))
    if body.structural_tag is not None:
        found.append(("structural_tag", _structural_tag(body.structural_tag, "structural_tag")))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise FieldError(f"only one structured output constraint may be given; got {names}",
                         found[1][0])  # fmt: skip
    if found and len(found[0][1].spec.encode()) > MAX_CONSTRAINT_BYTES:
        raise FieldError(f"{found[0][0]} is too large: at most {MAX_CONSTRAINT_BYTES >> 10} "
                         "KiB as JSON", found[0][0])  # fmt: skip
    return found[0] if found else None


def check(compiler: GrammarCompiler, param: str, structured: StructuredOutput) -> None:
    """Compile ``structured`` as a worker will (with the tokenizer, up to its first mask),
    so a constraint a worker would refuse is a 400 naming ``param``. Blocks: a large
    schema takes a while, so callers run it off the event loop. The size bound applies to
    every constraint, those built from ``tools`` (a named function's or "required"'s) too:
    a 590 KB tool schema compiled for 19 s where the same ``guided_json`` was a 400."""
    if len(structured.spec.encode()) > MAX_CONSTRAINT_BYTES:
        raise FieldError(f"{param} is too large: at most {MAX_CONSTRAINT_BYTES >> 10} KiB as "
                         "the constraint's JSON", param)  # fmt: skip
    try:
        compiler.matcher(structured)
    except StructuredOutputError as error:
        raise FieldError(str(error), param) from error
