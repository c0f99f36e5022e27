"""Structured outputs: what a request's text must match, and its llguidance grammar.

One constraint per request, one of four kinds (vLLM's ``structured_outputs`` names):

- ``json``: a JSON schema, as JSON text (OpenAI's ``response_format`` ``json_schema``;
  ``json_object`` is the schema ``{"type": "object"}``);
- ``regex``: a regular expression the whole text must match;
- ``choice``: a JSON list of strings, one of which is the whole text;
- ``grammar``: a Lark or GBNF (llama.cpp's EBNF) grammar.

The router compiles a request's constraint once to refuse a bad one with a 400 before any
worker sees it; each worker compiles it again for its own matcher (``engine/grammar.py``).
llguidance (vLLM's ``guidance`` backend, a Rust library with no Python dependencies) is
imported only when a request carries a constraint, so nothing else needs it. Torch-free:
the router imports this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KINDS = ("json", "regex", "choice", "grammar")

# JSON is generated without optional whitespace: a model that may put any number of spaces
# or newlines between tokens can fill its whole budget with them (vLLM's
# ``disable_any_whitespace`` option, made the default).
_JSON_OPTIONS = {"whitespace_flexible": False}


class StructuredOutputError(ValueError):
    """A constraint that cannot be compiled (or llguidance is missing)."""


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What the generated text must match. ``spec`` is text in every kind (see the module
    docstring), so it crosses the wire as it is."""

    kind: str
    spec: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(
                f"kind must be one of {', '.join(KINDS)}; got {self.kind!r}"
            )
        if not isinstance(self.spec, str) or not self.spec:
            raise StructuredOutputError(f"a {self.kind} constraint needs a non-empty spec")


def require_llguidance() -> Any:
    """The llguidance module, or a ``StructuredOutputError`` saying it is missing."""
    try:
        import llguidance
    except ImportError as error:  # the GPU image may lack it; nothing else needs it
        raise StructuredOutputError(
            "structured outputs need the llguidance package (pip install llguidance)"
        ) from error
    return llguidance


def grammar_of(structured: StructuredOutput) -> str:
    """The llguidance grammar (its JSON text) for ``structured``, checked: raises
    ``StructuredOutputError`` with llguidance's message for a constraint that does not
    compile (a bad regex, schema or grammar, a choice list that is not strings)."""
    llguidance = require_llguidance()
    matcher = llguidance.LLMatcher
    kind, spec = structured.kind, structured.spec
    try:
        if kind == "json":
            grammar = matcher.grammar_from_json_schema(spec, defaults=_JSON_OPTIONS)
        elif kind == "regex":
            grammar = matcher.grammar_from_regex(spec)
        elif kind == "choice":
            choices = json.loads(spec)
            if not isinstance(choices, list) or not choices:
                raise StructuredOutputError("choice must be a non-empty list of strings")
            if not all(isinstance(c, str) for c in choices):
                raise StructuredOutputError("choice must be a non-empty list of strings")
            grammar = llguidance.grammar_from("choice", spec)
        else:
            grammar = llguidance.grammar_from("grammar", spec)
    except StructuredOutputError:
        raise
    except ValueError as error:  # bad JSON, or a GBNF grammar that does not convert
        raise StructuredOutputError(f"invalid {kind} constraint: {error}") from error
    message = matcher.validate_grammar(grammar)
    if message and not message.startswith("WARNING"):
        raise StructuredOutputError(f"invalid {kind} constraint: {message}")
    return grammar


def load_grammar_tokenizer(model_dir: str | Path, vocab_size: int, eos_token_ids: list[int]):
    """llguidance's view of a checkpoint's tokenizer (``tokenizer.json``), for a model
    whose logits have ``vocab_size`` columns (often more than the tokenizer's tokens).
    Takes ~1 s for a 128k vocabulary, so callers build it once, on first use."""
    from tokenizers import Tokenizer

    llguidance = require_llguidance()
    path = Path(model_dir) / "tokenizer.json"
    if not path.exists():
        raise StructuredOutputError(f"structured outputs need {path}; the checkpoint has none")
    if not eos_token_ids:
        raise StructuredOutputError("structured outputs need the model's EOS token id")
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return llguidance.LLTokenizer(
        tokenizer.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids)
    )
