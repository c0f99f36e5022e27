"""Each spelling of a structured-output constraint (OpenAI's response_format, vLLM's
structured_outputs and guided_* fields) gives one StructuredOutput; bad or conflicting
ones are refused naming their field."""

from __future__ import annotations

import json

import pytest

from common.structured_output import GrammarCompiler, StructuredOutput
from common.tokenizer import Tokenizer
from router.protocol import ChatCompletionRequest, CompletionRequest, FieldError
from router.structured import ANY_JSON_OBJECT, check, structured_output_of

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# vLLM's structural tag: free text, and a call to f wrapped in its tags matches SCHEMA.
TAG = {"structures": [{"begin": "<function=f>", "schema": SCHEMA, "end": "</function>"}],
       "triggers": ["<function="]}  # fmt: skip
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def compiler(tiny_llama) -> GrammarCompiler:
    return GrammarCompiler(tiny_llama, 2048)


def _of(chat: bool = False, **fields) -> StructuredOutput | None:
    body = (ChatCompletionRequest(messages=MESSAGES, **fields) if chat
            else CompletionRequest(prompt="hi", **fields))  # fmt: skip
    found = structured_output_of(body)
    return None if found is None else found[1]


def _checked(compiler: GrammarCompiler, **fields) -> None:
    found = structured_output_of(CompletionRequest(prompt="hi", **fields))
    assert found is not None
    check(compiler, *found)


@pytest.mark.parametrize("chat", [False, True])
def test_every_spelling_gives_the_same_constraint(chat):
    schema = StructuredOutput("json", json.dumps(SCHEMA))
    cases = [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": SCHEMA}}}, schema),
        ({"structured_outputs": {"json": SCHEMA}}, schema),
        ({"guided_json": SCHEMA}, schema),
        ({"guided_json": json.dumps(SCHEMA)}, schema),
        ({"response_format": {"type": "json_object"}}, StructuredOutput("json", ANY_JSON_OBJECT)),
        ({"structured_outputs": {"json_object": True}},
         StructuredOutput("json", ANY_JSON_OBJECT)),
        ({"guided_regex": "[a-z]+"}, StructuredOutput("regex", "[a-z]+")),
        ({"structured_outputs": {"regex": "[a-z]+", "disable_any_whitespace": True}},
         StructuredOutput("regex", "[a-z]+")),
        ({"guided_choice": ["a", "b c"]}, StructuredOutput("choice", '["a", "b c"]')),
        ({"structured_outputs": {"choice": ["a", "b c"]}},
         StructuredOutput("choice", '["a", "b c"]')),
        ({"guided_grammar": 'root ::= "yes" | "no"'},
         StructuredOutput("grammar", 'root ::= "yes" | "no"')),
        ({"guided_regex": "[0-9]", "guided_decoding_backend": "xgrammar"},
         StructuredOutput("regex", "[0-9]")),
        ({"response_format": {"type": "text"}}, None),
        ({}, None),
    ]  # fmt: skip
    for fields, expected in cases:
        assert _of(chat, **fields) == expected, fields


@pytest.mark.parametrize(
    ("fields", "param", "match"),
    [
        ({"guided_regex": "[a-"}, "guided_regex", "invalid regex"),
        ({"guided_json": "{nope"}, "guided_json", "the text given is not JSON"),
        ({"structured_outputs": {"json": 5}}, "structured_outputs", "must be a JSON schema"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_grammar": "start: missing"}, "guided_grammar", "invalid grammar"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format", "schema is required"),
        ({"response_format": {"type": "yaml"}}, "response_format", "not supported"),
        # (a schema without its type went unenforced: free text, a 200)
        ({"response_format": {"json_schema": {"name": "x", "schema": {"type": "object"}}}},
         "response_format", "type is required"),
        ({"response_format": {}}, "response_format", "type is required"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
         "only one"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "not JSON"),
        ({"structured_outputs": {"nope": "x"}}, "structured_outputs", "not supported"),
        ({"structural_tag": {"format": {"type": "triggered_tags"}}}, "structural_tag",
         "'format' form"),
        ({"structural_tag": {**TAG, "triggers": ["<tool"]}}, "structural_tag",
         r"structures\[0\].begin must start with one of the triggers"),
        ({"structural_tag": {**TAG, "structures": []}}, "structural_tag", "non-empty list"),
        ({"response_format": {**TAG, "type": "structural_tag", "triggers": []}},
         "response_format", "triggers must be"),
        ({"structural_tag": {**TAG, "structures": [{"begin": "<function=f>", "end": "",
                                                     "schema": {"type": "nonsense"}}]}},
         "structural_tag", "invalid"),
        ({"structural_tag": {**TAG, "structures": [{"begin": "<function=f>", "end": "",
                                                     "schema": 'start: "a"'}]}},
         "structural_tag", "must be a JSON schema"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
         "only one"),
    ],
)  # fmt: skip
def test_bad_or_conflicting_constraints_name_their_field(compiler, fields, param, match):
    with pytest.raises(FieldError, match=match) as info:
        _checked(compiler, **fields)
    assert info.value.param == param


def test_a_structural_tag_leaves_text_free_and_holds_the_tagged_call_to_its_schema(
    compiler, tiny_llama
):
    """Each spelling of vLLM's structural tag is one grammar (llguidance's StructTag, as
    vLLM builds it); fed token by token, text without the trigger and a call matching the
    schema pass (JSON without free spaces, as every constraint here writes it), a call
    that does not is cut where it goes wrong."""
    spellings = [
        {"response_format": {"type": "structural_tag", **TAG}},
        {"structured_outputs": {"structural_tag": json.dumps(TAG)}},
        {"structural_tag": json.dumps(TAG)},
        {"structural_tag": TAG},
    ]
    (structured,) = {_of(chat=True, **fields) for fields in spellings}
    anything = {**TAG, "structures": [{**TAG["structures"][0], "schema": True}]}
    check(compiler, "structural_tag", _of(structural_tag=anything))  # JSON Schema's true
    assert structured.kind == "grammar" and "<function=" in structured.spec
    tokenizer = Tokenizer(tiny_llama)

    def consumed(text: str) -> float:
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        return compiler.matcher(structured).try_consume_tokens(token_ids) / len(token_ids)

    assert consumed("Sure, no call needed.") == 1.0
    assert consumed('Calling: <function=f>{"a": 12}</function> and done.') == 1.0
    assert consumed('Calling: <function=f>{"b": 12}</function>') < 1.0
    # json.dumps's separators, no others: as templates print arguments back (tojson), so
    # the next turn's prompt holds the call as generated.
    assert consumed('Calling: <function=f>{"a":12}</function>') < 1.0
    assert consumed('Calling: <function=f>{"a":  12}</function>') < 1.0
    plain = compiler.matcher(_of(guided_json={"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "integer"}}},
        "required": ["a", "b"], "additionalProperties": False}))  # fmt: skip
    text = json.dumps({"a": 1, "b": [2, 3]})
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    assert plain.try_consume_tokens(token_ids) == len(token_ids) and plain.is_accepting()


def test_disable_additional_properties_holds_objects_to_their_declared_keys(compiler, tiny_llama):
    """vLLM's option for its llguidance backend: every object schema that lists
    properties and says nothing of others gets ``additionalProperties: false`` (explicit
    ones kept). Accepted and ignored, objects took keys the schema never declared."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {
        "type": "object", "properties": {"c": {"type": "string"}}}, "d": {
        "type": "object", "properties": {}, "additionalProperties": True}}}  # fmt: skip
    plain = _of(structured_outputs={"json": schema})
    strict = _of(structured_outputs={"json": schema, "disable_additional_properties": True})
    assert plain.spec == json.dumps(schema)
    held = json.loads(strict.spec)
    assert held["additionalProperties"] is False
    assert held["properties"]["b"]["additionalProperties"] is False
    assert held["properties"]["d"]["additionalProperties"] is True  # (said so: kept)
    tokenizer = Tokenizer(tiny_llama)

    def accepts(structured, text: str) -> bool:
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        matcher = compiler.matcher(structured)
        return matcher.try_consume_tokens(token_ids) == len(token_ids)

    extra = '{"a": 1, "z": 2}'
    assert accepts(plain, extra) and not accepts(strict, extra)
    assert accepts(strict, '{"a": 1, "b": {"c": "x"}}')


def test_what_only_the_tokenizer_shows_is_refused_too(compiler):
    """Grammars naming a token id or a special token the vocabulary lacks: without the
    tokenizer they compile, and a worker would refuse them after admission."""
    for fields, param in (({"guided_grammar": 'start: "a" <[5000]>'}, "guided_grammar"),
                          ({"structured_outputs": {"grammar": 'start: "a" <|nope|>'}},
                           "structured_outputs")):  # fmt: skip
        with pytest.raises(FieldError, match="invalid") as info:
            _checked(compiler, **fields)
        assert info.value.param == param
        assert "\n" not in str(info.value) and len(str(info.value)) < 400  # no grammar dump
    _checked(compiler, guided_regex="a{1,100}")  # and what is fine passes


def test_a_choice_of_thousands_of_strings_holds_past_the_first_token(compiler, tiny_llama):
    """Each string of a choice one alternative of a terminal: as rules of their own (what
    llguidance's ``choice`` grammar builds), 2,500 strings compiled, then the parser
    refused the first token generated (2,500 items in a row, 2,000 allowed)."""
    choices = [f"option number {index} of many" for index in range(2500)] + ["", "😀 é\t\\d"]
    structured = _of(guided_choice=choices)
    check(compiler, "guided_choice", structured)
    tokenizer = Tokenizer(tiny_llama)
    for text in (choices[0], choices[1234], choices[-1]):
        matcher = compiler.matcher(structured)
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        assert matcher.try_consume_tokens(token_ids) == len(token_ids), matcher.get_error()
        assert matcher.is_accepting()
    assert compiler.matcher(structured).is_accepting()  # the empty string is one of them
    wrong = tokenizer.encode("option number 2500 of many", add_special_tokens=False)
    matcher = compiler.matcher(structured)
    assert matcher.try_consume_tokens(wrong) < len(wrong)
