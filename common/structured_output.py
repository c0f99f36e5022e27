"""Structured outputs: what a request's text must match, and its llguidance grammar.

One constraint per request, one of four kinds (vLLM's ``structured_outputs`` names):

- ``json``: a JSON schema, as JSON text (OpenAI's ``response_format`` ``json_schema``;
  ``json_object`` is the schema ``{"type": "object"}``);
- ``regex``: a regular expression the whole text must match;
- ``choice``: a JSON list of strings, one of which is the whole text;
- ``grammar``: a Lark or GBNF (llama.cpp's EBNF) grammar.

With a reasoning parser (``router/reasoning.py``) the constraint applies after the
model's thinking: ``reasoning_start`` / ``reasoning_end`` (its tags) wrap it in a
grammar whose first part is the thinking (``_after_reasoning``): any text up to the end
tag, opened by the start tag where the output writes it; the constraint follows the end
tag at once (the answer the router returns is all text after the tag, so any blank
allowed between them would break the constraint's promise: an audit found " yes" of a
choice returned as "yes"). The thinking is free and the answer constrained, as in vLLM;
unlike vLLM's, the output cannot end before the thinking does (the EOS is masked until
the constraint is complete). A tag that is one added token of the tokenizer (Qwen3's) is
matched as that token: llguidance keeps added tokens out of free text.

The router compiles a request's constraint (``GrammarCompiler``) to refuse a bad one with a
400 before any worker sees it; each worker compiles it again for its own matcher
(``engine/grammar.py``).
llguidance (vLLM's ``guidance`` backend, a Rust library with no Python dependencies) is
imported only when a request carries a constraint, so nothing else needs it. Torch-free:
the router imports this module.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KINDS = ("json", "regex", "choice", "grammar")
# The field a worker names when it refuses a request's constraint (SamplingParams', the
# proto's); the router names the one the client gave it in instead.
STRUCTURED_OUTPUT = "structured_output"

# JSON is generated without optional whitespace: a model that may put any number of spaces
# or newlines between tokens can fill its whole budget with them (vLLM's
# ``disable_any_whitespace`` option, made the default). Its separators are ``json.dumps``'s
# (", " and ": "), as xgrammar's are without whitespace (vLLM's default backend) and as
# chat templates print arguments (``tojson``): generated compact, a tool call's arguments
# came back re-printed with spaces in the next turn's prompt, whose prefix then broke at
# every call (GPT-OSS's every constrained call; a prefix-stability audit).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredOutputError(ValueError):
    """A constraint that cannot be compiled (or llguidance is missing)."""


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What the generated text must match. ``spec`` is text in every kind (see the module
    docstring), so it crosses the wire as it is. With the thinking tags set (e.g.
    ``<think>``, ``</think>``) the constraint applies after the model's thinking: the
    output starts inside it (and may write the start tag first), or, with
    ``reasoning_optional``, either opens it with the start tag or goes straight to the
    constrained part, writing ``reasoning_skip`` first (GPT-OSS's final channel header:
    without it an answer with no analysis was no Harmony, and the next turn's prompt, which
    renders the header, broke its prefix at the reply's first token)."""

    kind: str
    spec: str
    reasoning_start: str = ""
    reasoning_end: str = ""
    reasoning_optional: bool = False
    reasoning_skip: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(
                f"kind must be one of {', '.join(KINDS)}; got {self.kind!r}"
            )
        if not isinstance(self.spec, str) or not self.spec:
            raise StructuredOutputError(f"a {self.kind} constraint needs a non-empty spec")
        if bool(self.reasoning_start) != bool(self.reasoning_end):
            raise StructuredOutputError("reasoning_start and reasoning_end go together")
        if self.reasoning_optional and not self.reasoning_end:
            raise StructuredOutputError("reasoning_optional needs the reasoning tags")
        if self.reasoning_skip and not self.reasoning_optional:
            raise StructuredOutputError("reasoning_skip needs reasoning_optional")


def require_llguidance() -> Any:
    """The llguidance module, or a ``StructuredOutputError`` saying it is missing."""
    try:
        import llguidance
    except ImportError as error:  # the GPU image may lack it; nothing else needs it
        raise StructuredOutputError(
            "structured outputs need the llguidance package (pip install llguidance)"
        ) from error
    return llguidance


def first_line(message: str, limit: int = 300) -> str:
    """llguidance's errors carry its parser state and the whole grammar after the first
    line: the client gets the reason, not a dump of the grammar it sent."""
    line = message.strip().splitlines()[0] if message.strip() else "unknown error"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def grammar_of(structured: StructuredOutput, tag_tokens: dict[str, int] | None = None) -> str:
    """The llguidance grammar (its JSON text) for ``structured``, checked without a
    tokenizer: raises ``StructuredOutputError`` with llguidance's reason for a constraint
    that does not compile (a bad regex, schema or grammar, a choice list that is not
    strings). ``GrammarCompiler.matcher`` checks the rest. ``tag_tokens``: the added
    tokens of the tokenizer in the thinking tags, by their text, and their ids."""
    llguidance = require_llguidance()
    matcher = llguidance.LLMatcher
    kind, spec = structured.kind, structured.spec
    try:
        if kind == "json":
            grammar = matcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
        elif kind == "regex":
            grammar = matcher.grammar_from_regex(spec)
        elif kind == "choice":
            choices = json.loads(spec)
            strings = isinstance(choices, list) and all(isinstance(c, str) for c in choices)
            if not strings or not choices:
                raise StructuredOutputError("choice must be a non-empty list of strings")
            grammar = llguidance.grammar_from("lark", _choice_lark(choices))
        else:
            grammar = llguidance.grammar_from("grammar", spec)
    except StructuredOutputError:
        raise
    except ValueError as error:  # bad JSON, or a GBNF grammar that does not convert
        raise StructuredOutputError(
            f"invalid {kind} constraint: {first_line(str(error))}"
        ) from error
    message = matcher.validate_grammar(grammar)
    if message and not message.startswith("WARNING"):
        raise StructuredOutputError(f"invalid {kind} constraint: {first_line(message)}")
    if structured.reasoning_end:
        grammar = _after_reasoning(grammar, structured, tag_tokens or {})
    return grammar


def _choice_lark(choices: list[str]) -> str:
    """One of ``choices`` as the whole text, as one terminal: the lexer matches the
    alternation. llguidance's own ``choice`` grammar makes each string a rule of its own,
    one Earley item each, and its parser stops at 2,000 items in a row: a choice of 2,500
    compiled, then failed on the first token generated."""
    return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(choice) for choice in choices)


def _after_reasoning(grammar: str, structured: StructuredOutput, tag_tokens: dict[str, int]) -> str:
    """``grammar`` (llguidance's JSON, or Lark text) preceded by the model's thinking.
    The thinking's text ends at the end tag: as text, a lazy lexeme (it ends at the first
    one); where the tag begins with an added token, which free text cannot hold, where
    that token comes. A tag's added tokens (``tag_tokens``, by their text) are matched as
    those tokens, its other text as text: GPT-OSS's end of thinking is
    ``<|end|><|start|>assistant<|channel|>final<|message|>``, four tokens and two words."""
    try:
        top = json.loads(grammar)
    except ValueError:  # Lark text (choice, grammar)
        top = {"grammars": [{"lark_grammar": grammar}]}
    (inner,) = top["grammars"]  # one grammar: the constraint's own
    longest_first = sorted(tag_tokens, key=len, reverse=True)
    tokens = re.compile("(" + "|".join(re.escape(text) for text in longest_first) + ")")

    def tag(text: str) -> str:
        if not tag_tokens:
            return json.dumps(text)
        return " ".join(
            f"<[{tag_tokens[piece]}]>" if piece in tag_tokens else json.dumps(piece)
            for piece in tokens.split(text)
            if piece
        )

    start, end = structured.reasoning_start, structured.reasoning_end
    if tag_tokens and tokens.match(end):
        body = f"thought: TEXT {tag(end)}"
    else:
        body = f"thought[lazy]: TEXT {tag(end)}"
    optional = structured.reasoning_optional
    skip = structured.reasoning_skip
    head = "(thinking | skipped)" if skip else f"thinking{'?' if optional else ''}"
    lark = "\n".join([
        f"start: {head} @constrained",
        # Optional: the block opens with the start tag. Else the output is in it already,
        # and may write the start tag first.
        f"thinking: {tag(start)}{'' if optional else '?'} thought",
        body,
        "TEXT: /(.|\\n)*/",
        *([f"skipped: {tag(skip)}"] if skip else []),
    ])  # fmt: skip
    return json.dumps({"grammars": [{"lark_grammar": lark}, {**inner, "name": "constrained"}]})


class GrammarCompiler:
    """Constraints compiled against one checkpoint's tokenizer, into matchers as the
    workers run them. Besides what ``grammar_of`` checks, a matcher's construction and
    first mask catch what needs the vocabulary (a grammar naming tokens the tokenizer
    lacks) or more work than llguidance's limits allow (the lexer of ``a{1000000}``).
    Thread-safe, so the router compiles on worker threads and an engine off its own.

    ``eos_token_ids`` (None: the tokenizer's own) are the tokens a complete grammar
    allows; the router, which only checks, leaves them to the tokenizer.
    """

    CACHE_SIZE = 64  # compiled grammars kept (n > 1 and retries repeat one)

    def __init__(
        self, model_dir: str | Path, vocab_size: int, eos_token_ids: list[int] | None = None
    ) -> None:
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._lock = threading.Lock()
        self._tokenizer: Any = None  # llguidance.LLTokenizer, built on first use
        self._grammars: dict[StructuredOutput, str] = {}

    def tokenizer(self) -> Any:
        """llguidance's view of the checkpoint's ``tokenizer.json`` (~1 s to build for a
        128k vocabulary: built once, on first use or ``warm_up``)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = _load_tokenizer(
                    self.model_dir, self.vocab_size, self.eos_token_ids
                )
            return self._tokenizer

    def matcher(self, structured: StructuredOutput) -> Any:
        """A fresh ``llguidance.LLMatcher`` for ``structured``, its first mask computed.
        Raises ``StructuredOutputError`` with llguidance's reason."""
        llguidance = require_llguidance()
        tokenizer = self.tokenizer()
        with self._lock:
            grammar = self._grammars.get(structured)
        if grammar is None:
            grammar = grammar_of(structured, _tag_tokens(tokenizer, structured))
            with self._lock:
                if len(self._grammars) >= self.CACHE_SIZE:
                    del self._grammars[next(iter(self._grammars))]  # the oldest
                self._grammars[structured] = grammar
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        if not matcher.is_error():
            matcher.compute_bitmask()  # where lexers are built, and may exceed the limits
        if matcher.is_error():
            reason = first_line(matcher.get_error())
            raise StructuredOutputError(f"invalid {structured.kind} constraint: {reason}")
        return matcher


def _tag_tokens(tokenizer: Any, structured: StructuredOutput) -> dict[str, int]:
    """The added tokens of ``tokenizer`` in the thinking tags of ``structured``, by
    their text."""
    found = {}
    for text in (structured.reasoning_start, structured.reasoning_end, structured.reasoning_skip):
        for token in tokenizer.tokenize_str(text) if text else ():
            if tokenizer.is_special_token(token):
                found[tokenizer.decode_str([token])] = token
    return found


def _load_tokenizer(model_dir: Path, vocab_size: int, eos_token_ids: list[int] | None) -> Any:
    from tokenizers import Tokenizer

    llguidance = require_llguidance()
    path = model_dir / "tokenizer.json"
    if not path.exists():
        raise StructuredOutputError(f"structured outputs need {path}; the checkpoint has none")
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    eos = list(eos_token_ids) if eos_token_ids else None
    return llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos)
