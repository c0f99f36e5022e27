"""Tokenizer and chat templates without transformers or torch (the router must start fast
and torch-free).

Reads a checkpoint's ``tokenizer.json`` with the ``tokenizers`` library (the same Rust code
transformers' fast tokenizers run), its special tokens from ``special_tokens_map.json`` and
``tokenizer_config.json``, and its chat templates from ``chat_template.jinja`` (and
``additional_chat_templates/``) or else ``tokenizer_config.json`` (the files win, as in
transformers; ``tool_use`` is the one for a request with tools where a checkpoint names
one, as transformers picks it; a processor's ``chat_template.json`` first for a request
without tools, as vLLM picks it), rendered in a
sandboxed Jinja environment the way transformers renders it: the same variables (every
special token, ``tools`` and ``documents`` None), the same filters and globals, and its
``{% generation %}`` tag. Tests check token-for-token agreement with
``transformers.AutoTokenizer``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from common.token_pieces import TokenPieces

# From this many characters ``encode`` lets go of Python's lock (~10 ms of encoding).
_ENCODE_UNLOCKED_CHARS = 16_384
# With a token limit (``encode``'s ``max_tokens``), a text longer than a slice is counted
# a slice at a time before it is encoded whole. A slice is 8 characters per token of the
# limit (about twice English text's), so one slice mostly decides, within these bounds.
_MIN_SLICE_CHARS = 1 << 16
_SLICE_CHARS = 1 << 20
# Tokens a cut between slices may add (a prefix space, a word split differently).
_CUT_SLACK_TOKENS = 8
# Characters a kept token spans, for ``KeptTokens``'s first cut: far above any vocabulary's
# average (~4 for English text). Not a bound (cl100k's vocabulary has tokens of 64+
# characters, separator lines and runs of spaces): a cut that yields too few tokens is
# widened (``KeptTokens.cuts``).
CHARS_PER_TOKEN_BOUND = 16


@dataclass(frozen=True, slots=True)
class KeptTokens:
    """What truncation will keep of a text's tokens: the last ``num_tokens`` (or the
    first, when not ``from_end``). ``encode`` then reads only ``CHARS_PER_TOKEN_BOUND``
    characters a kept token from that side: a 24 MB prompt truncated to 4k tokens took
    14 s and 4.8 GB of router memory tokenized whole, to keep its last 4k tokens."""

    num_tokens: int
    from_end: bool = True

    def ids(self, token_ids: list[int]) -> list[int]:
        """The ids kept of a text's ids."""
        return token_ids[-self.num_tokens :] if self.from_end else token_ids[: self.num_tokens]

    def cuts(self, text: str) -> Iterator[str]:
        """``text`` cut on the kept side to ``CHARS_PER_TOKEN_BOUND`` characters a kept
        token, then to twice as many each time, up to the whole text: the caller takes the
        first cut that holds more tokens than it keeps (``holds``), since a cut of long
        tokens (a separator line of 32-character tokens) held fewer, and truncation kept
        fewer tokens than asked, a BOS among them (an audit)."""
        num_chars = self.num_tokens * CHARS_PER_TOKEN_BOUND
        while len(text) > num_chars:
            yield text[-num_chars:] if self.from_end else text[:num_chars]
            num_chars *= 2
        yield text

    def holds(self, num_text_tokens: int) -> bool:
        """Whether a cut of ``num_text_tokens`` tokens (special ones not counted) gives
        the kept tokens as the whole text's: all of them, and room for the tokens at the
        cut, which may differ from the whole text's."""
        return num_text_tokens >= self.num_tokens + _CUT_SLACK_TOKENS


class TemplateArguments(dict):
    """A tool call's arguments as a chat template sees them: the object most templates
    read (``arguments | tojson``, ``arguments.items()``), which reads as the JSON text
    the client sent where a template uses it as a string (``'...' + arguments``,
    ``{{ arguments }}``: DeepSeek's, which refused every conversation with an earlier
    call when given the object, as transformers renders the text)."""

    def __init__(self, value: dict[str, Any], text: str) -> None:
        super().__init__(value)
        self.text = text

    def __str__(self) -> str:
        return self.text

    def __add__(self, other: object) -> str:
        if isinstance(other, str):
            return self.text + other
        return NotImplemented

    def __radd__(self, other: object) -> str:
        if isinstance(other, str):
            return other + self.text
        return NotImplemented


class TokenizerError(ValueError):
    """``param``: the request field at fault where it is not the messages (None)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class TooManyTokens(TokenizerError):
    """A text found, before it was encoded whole, to hold more tokens than allowed:
    ``at_least`` of them."""

    def __init__(self, at_least: int) -> None:
        super().__init__(f"the text has at least {at_least} tokens")
        self.at_least = at_least


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


# Client text that spells a control token, when escaped (``Tokenizer.escape_special``):
# the token's text between these private-use characters through the template (so its
# string tests and splits still see it), then encoded as plain text. transformers'
# markers (``sanitize_control_tokens``), so the ids are its ids.
_MARK_START, _MARK_END = "\U000f0000", "\U000f0001"


_ESCAPED_MARK_START, _ESCAPED_MARK_END = (json.dumps(m)[1:-1] for m in (_MARK_START, _MARK_END))


@dataclass(frozen=True, slots=True)
class _ControlTokens:
    """A template's control tokens (``Tokenizer._control``): ``found`` matches one in
    client text, ``marked`` one between the markers in the rendered text, or a lone
    marker (a template's string method split a pair: dropped, but it still breaks the
    text, so the text on either side cannot join into a token)."""

    texts: frozenset[str]
    found: re.Pattern[str]
    marked: re.Pattern[str]


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file's contents; {} when it is absent or not an object."""
    if not path.exists():
        return {}
    value = json.loads(path.read_text())
    return value if isinstance(value, dict) else {}


def special_tokens_of(model_dir: Path) -> dict[str, Any]:
    """A checkpoint's special tokens by role (``bos_token``, ``eos_token``, ...,
    ``additional_special_tokens``), as transformers (4.x and 5) reads them:
    ``tokenizer_config.json``'s; where it has no ``added_tokens_decoder`` (a checkpoint
    saved before transformers 4.34), ``special_tokens_map.json``'s over them. Older
    checkpoints keep bos and eos only in the map: read from the config alone, their
    templates rendered ``bos_token`` as "" and their EOS stopped nothing."""
    config = _read_json(model_dir / "tokenizer_config.json")
    sources = [config]
    if "added_tokens_decoder" not in config:  # (transformers' legacy path: the map wins)
        sources.append(_read_json(model_dir / "special_tokens_map.json"))
    special: dict[str, Any] = {}
    for source in sources:
        for key, value in source.items():
            if key.endswith("_token") and (text := _token_text(value)) is not None:
                special[key] = text
            elif key == "additional_special_tokens" and isinstance(value, list):
                special[key] = [_token_text(token) for token in value]
    return special


def tokenizer_eos_token_id(model_dir: str | Path) -> int | None:
    """The id of the tokenizer's ``eos_token`` (``special_tokens_of``) in
    ``tokenizer.json``; None when it names none, or the checkpoint has no tokenizer.
    (Not from ``added_tokens_decoder``, which would spare loading the vocabulary: a stale
    one gave the engine another EOS than the router's and transformers'.)"""
    from tokenizers import Tokenizer as RustTokenizer

    model_dir = Path(model_dir)
    eos = special_tokens_of(model_dir).get("eos_token")
    path = model_dir / "tokenizer.json"
    if not isinstance(eos, str) or not path.exists():
        return None
    return RustTokenizer.from_file(str(path)).token_to_id(eos)


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        self.model_dir = Path(model_dir)
        path = self.model_dir / "tokenizer.json"
        if not path.exists():
            raise TokenizerError(f"{self.model_dir} has no tokenizer.json")
        self._tok = RustTokenizer.from_file(str(path))
        self._config = _read_json(self.model_dir / "tokenizer_config.json")
        # What templates see as bos_token, eos_token, pad_token, ... (transformers passes
        # its whole special-tokens map).
        self.special_tokens = special_tokens_of(self.model_dir)
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.chat_templates = self._load_chat_templates()
        # A processor's template (``chat_template.json``, as older vision-language
        # checkpoints ship theirs): vLLM's second choice, before the tokenizer's, for a
        # request without tools.
        processor = _read_json(self.model_dir / "chat_template.json").get("chat_template")
        self.processor_template: str | None = processor if isinstance(processor, str) else None
        self.chat_template = self.template_for(None)  # the default

    def _load_chat_templates(self) -> dict[str | None, str]:
        """The checkpoint's chat templates by name (None: the default), as transformers
        reads them: ``chat_template.jinja`` (the default) and ``additional_chat_templates/
        <name>.jinja``, else ``tokenizer_config.json``'s (one, or a list of named ones)."""
        templates: dict[str | None, str] = {}
        jinja_file = self.model_dir / "chat_template.jinja"
        extra_dir = self.model_dir / "additional_chat_templates"
        if jinja_file.exists() or extra_dir.is_dir():
            if jinja_file.exists():
                templates[None] = jinja_file.read_text()
            for path in sorted(extra_dir.glob("*.jinja")) if extra_dir.is_dir() else ():
                templates[path.stem] = path.read_text()
            return templates
        template = self._config.get("chat_template")
        if isinstance(template, list):
            for named in template:
                name, text = named.get("name"), named.get("template")
                if isinstance(text, str):
                    templates[None if name == "default" else name] = text
        elif isinstance(template, str):
            templates[None] = template
        return templates

    def template_for(self, tools: list[dict[str, Any]] | None) -> str | None:
        """The template a request renders with, as transformers picks it: ``tool_use``
        where it has tools and the checkpoint names one (Hermes-2-Pro's: only it renders
        the tools), else the default, else the only one."""
        templates = self.chat_templates
        if tools is None and self.processor_template is not None:
            return self.processor_template
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if None in templates:
            return templates[None]
        if len(templates) == 1:
            return next(iter(templates.values()))
        return self.processor_template if not templates else None

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_templates) or self.processor_template is not None

    def encode(
        self,
        text: str,
        add_special_tokens: bool = True,
        max_tokens: int | None = None,
        kept: KeptTokens | None = None,
    ) -> list[int]:
        """``text``'s ids. A long text goes through the batch call, which lets go of
        Python's lock while it works (``encode`` holds it): the router encodes on a
        thread, and a prompt of 2M characters held its event loop, every stream and
        health answer, for 2 s; through the batch call the loop waits at most ~60 ms.
        The ids are the same either way (tested); short texts keep the cheaper call.

        ``max_tokens``: a text that surely holds more raises ``TooManyTokens`` instead.
        Past a slice's length it is counted a slice at a time first, stopping once the
        count passes the limit: a 30 MB prompt took 11 s and 4.3 GB to encode whole,
        only to be refused for a 2k-token context.

        ``kept``: the caller keeps only these tokens (``KeptTokens``); the text is cut
        to them first (``KeptTokens.cuts``: the first cut that holds them), and the
        caller truncates the ids as it would have."""
        if kept is None:
            return self._encode(text, add_special_tokens, max_tokens)
        added = self.num_special_added if add_special_tokens else 0
        for cut in kept.cuts(text):
            ids = self._encode(cut, add_special_tokens, max_tokens)
            if len(cut) == len(text) or kept.holds(len(ids) - added):
                return ids
        raise AssertionError("the last cut is the whole text")

    def cut_to_kept(self, text: str, kept: KeptTokens) -> str:
        """The shortest of ``kept.cuts(text)`` that holds what ``kept`` keeps."""
        for cut in kept.cuts(text):
            if len(cut) == len(text) or kept.holds(len(self._encode(cut, False, None))):
                return cut
        raise AssertionError("the last cut is the whole text")

    @cached_property
    def num_special_added(self) -> int:
        """The special tokens ``encode(..., add_special_tokens=True)`` adds (a BOS...)."""
        return len(self._tok.encode("", add_special_tokens=True).ids)

    def _encode(self, text: str, add_special_tokens: bool, max_tokens: int | None) -> list[int]:
        if max_tokens is not None:
            slice_chars = min(_SLICE_CHARS, max(_MIN_SLICE_CHARS, 8 * max_tokens))
            if len(text) > slice_chars:
                self._count_up_to(text, max_tokens, slice_chars)
        if len(text) < _ENCODE_UNLOCKED_CHARS:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        (encoding,) = self._encode_batch([text], add_special_tokens=add_special_tokens)
        return encoding.ids

    def _count_up_to(self, text: str, max_tokens: int, slice_chars: int) -> None:
        """Raise ``TooManyTokens`` if ``text``, counted in slices cut before a space
        (where tokenizers split words anyway), surely holds more than ``max_tokens``
        tokens. Each cut may add up to ``_CUT_SLACK_TOKENS``, which the count forgives."""
        counted = num_slices = start = 0
        while start < len(text):
            end = min(start + slice_chars, len(text))
            if end < len(text):
                space = text.rfind(" ", start + slice_chars // 2, end)
                end = space if space > start else end
            (encoding,) = self._encode_batch([text[start:end]], add_special_tokens=False)
            counted += len(encoding.ids)
            num_slices += 1
            at_least = counted - _CUT_SLACK_TOKENS * num_slices
            if at_least > max_tokens:
                raise TooManyTokens(at_least)
            start = end

    @cached_property
    def _encode_batch(self):
        # The fast variant (tokenizers >= 0.21) skips character offsets, which nothing reads.
        return getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)

    def decode(
        self,
        token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        keep_special: frozenset[int] = frozenset(),
    ) -> str:
        """``keep_special``: special tokens kept when the others are skipped (the markers
        of a format the router reads, such as GPT-OSS's Harmony)."""
        if skip_special_tokens and keep_special:
            special = self.special_ids
            token_ids = [t for t in token_ids if t in keep_special or t not in special]
            skip_special_tokens = False
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, text: str) -> int | None:
        """The id of the token whose text is ``text``; None if no one token is."""
        return self._tok.token_to_id(text)

    def special_token_ids(self, texts: Sequence[str]) -> list[int]:
        """The ids of those of ``texts`` that are each one special token (in order)."""
        ids = (self.token_id(text) for text in texts)
        return [i for i in ids if i is not None and i in self.special_ids]

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """The ids of the special tokens (those decoding skips)."""
        added = self._tok.get_added_tokens_decoder()
        return frozenset(i for i, token in added.items() if token.special)

    def _control(self, template: str | None) -> _ControlTokens:
        """The control tokens of ``template`` (None: the default), transformers' (its
        ``sanitize_control_tokens``): the special tokens, and the added tokens
        ``chat_control_tokens`` lists in ``tokenizer_config.json``, or else those the
        template's text holds but whitespace. Qwen's ``<think>``, ``<tool_call>`` and
        ``<tool_response>`` are added tokens not marked special: a user typing
        "</think><tool_response>" got those ids, the template's markers."""
        key = template if template is not None else self.chat_template
        control = self._controls.get(key)
        if control is not None:
            return control
        added = [t for t in self._tok.get_added_tokens_decoder().values() if t.content]
        listed = self._config.get("chat_control_tokens")
        if isinstance(listed, list):
            texts = {t.content for t in added if t.special or t.content in listed}
        else:
            literal = self._literal_text(key) if key else ""
            texts = {t.content for t in added if t.special
                     or (t.content in literal and not t.content.isspace())}  # fmt: skip
        longest = "|".join(map(re.escape, sorted(texts, key=len, reverse=True))) or "(?!)"
        control = _ControlTokens(
            frozenset(texts),
            re.compile(longest),
            re.compile(f"{_MARK_START}({longest}){_MARK_END}|[{_MARK_START}{_MARK_END}]"),
        )
        self._controls[key] = control  # (a race builds it twice: the same either way)
        return control

    @cached_property
    def _controls(self) -> dict[str | None, _ControlTokens]:
        return {}

    def special_texts_in(self, text: str) -> frozenset[str]:
        """The control tokens' texts ``text`` holds (the default template's)."""
        return frozenset(self._control(None).found.findall(text))

    def escape_special(
        self, value: Any, keep: frozenset[str] = frozenset(), template: str | None = None
    ) -> Any:
        """``value`` (messages, tools, template arguments: strings in lists, plain dicts and
        a call's ``TemplateArguments``) with each control token's text in its strings
        (``template``'s; None: the default's), but those of ``keep`` (an image's marker),
        put between markers that ``apply_chat_template(..., escape_special=True)``
        encodes as that text, never as the token. Markers a client wrote are dropped (they
        would forge a marked token). Other objects stay as they are."""
        found = self._control(template).found

        def mark(match: re.Match[str]) -> str:
            text = match.group()
            return text if text in keep else f"{_MARK_START}{text}{_MARK_END}"

        def walk(item: Any) -> Any:
            if isinstance(item, str):
                return found.sub(mark, item.replace(_MARK_START, "").replace(_MARK_END, ""))
            if isinstance(item, list):
                return [walk(x) for x in item]
            if isinstance(item, TemplateArguments):  # (its text is what some templates print)
                return TemplateArguments(walk(dict(item)), walk(item.text))
            if type(item) is dict:  # keys too: ``tojson`` prints an argument's name
                return {walk(key): walk(x) for key, x in item.items()}
            return item

        return walk(value)

    def _encode_without_added_tokens(self, text: str) -> list[int]:
        """``text``'s ids with no added token matched, special or not (transformers'
        way: the normalizer, the pre-tokenizer and the model, past the added tokens)."""
        tok = self._tok
        if tok.normalizer is not None:
            text = tok.normalizer.normalize_str(text)
        splits = [text]
        if tok.pre_tokenizer is not None:
            splits = [split for split, _ in tok.pre_tokenizer.pre_tokenize_str(text)]
        return [token.id for split in splits for token in tok.model.tokenize(split)]

    def _encode_escaped(
        self, text: str, control: _ControlTokens, max_tokens: int | None
    ) -> list[int]:
        """``text`` with marked tokens (``escape_special``): the rest as ``encode`` reads
        it, each marked token's text as plain text, lone markers dropped. A piece after
        the first is encoded after a newline, whose ids are then dropped, as transformers'
        ``sanitize_control_tokens`` does: encoded as the start of a text, each piece got
        the "▁" a SentencePiece-style tokenizer (Llama 2, Mistral) puts there, a space the
        client never wrote (an audit: "the <s>old</s> test" read "the  <s> old </s>  test")."""
        newline = self._tok.encode("\n", add_special_tokens=False).ids

        def plain(piece: str) -> list[int]:
            return self._encode_without_added_tokens(piece)

        def read(piece: str) -> list[int]:
            return self.encode(piece, add_special_tokens=False, max_tokens=max_tokens)

        def inside(piece: str, encode: Callable[[str], list[int]]) -> list[int]:
            after_newline = encode("\n" + piece)
            if after_newline[: len(newline)] == newline:
                return after_newline[len(newline) :]
            return encode(piece)

        ids: list[int] = []
        # [text, marked token or None (a lone marker), text, ...]
        for i, piece in enumerate(control.marked.split(text)):
            if not piece:
                continue
            if i % 2:
                ids += inside(piece, plain)
            else:
                ids += read(piece) if i == 0 else inside(piece, read)
            if max_tokens is not None and len(ids) > max_tokens:
                raise TooManyTokens(len(ids))
        return ids

    @cached_property
    def pieces(self) -> TokenPieces:
        """Each token's text after other text, and its bytes (for log-probs)."""
        return TokenPieces(
            lambda ids, skip: self._tok.decode(list(ids), skip_special_tokens=skip),
            self._tok.id_to_token,
        )

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return [self._tok.id_to_token(t) or "" for t in token_ids]

    @cached_property
    def _environment(self):  # -> jinja2.Environment
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            text = json.dumps(
                x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                sort_keys=sort_keys,
            )  # fmt: skip
            if ensure_ascii:  # the markers as they are: escaped, a marked token read as one
                text = text.replace(_ESCAPED_MARK_START, _MARK_START)
                text = text.replace(_ESCAPED_MARK_END, _MARK_END)
            return text

        class GenerationTag(jinja2.ext.Extension):
            """``{% generation %}...{% endgeneration %}`` marks assistant text for training
            masks in transformers; rendering its body unchanged is all serving needs."""

            tags = frozenset({"generation"})

            def parse(self, parser):
                next(parser.stream)
                return parser.parse_statements(("name:endgeneration",), drop_needle=True)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols", GenerationTag],
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env

    @cached_property
    def _compiled(self) -> dict[str, Any]:  # template text → jinja2.Template
        return {}

    def _template(self, text: str):  # -> jinja2.Template
        template = self._compiled.get(text)
        if template is None:  # (a race compiles it twice: the same either way)
            template = self._compiled[text] = self._environment.from_string(text)
        return template

    def _literal_text(self, template: str) -> str:
        """The template's literal strings (its raw text and string constants) joined by
        NULs, so no match spans two: where transformers looks for control tokens."""
        import jinja2.nodes

        tree = self._environment.parse(template)
        literals = {node.data for node in tree.find_all(jinja2.nodes.TemplateData)}
        literals |= {node.value for node in tree.find_all(jinja2.nodes.Const)
                     if isinstance(node.value, str)}  # fmt: skip
        return "\0".join(literals)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """``tools``: OpenAI's tool definitions, which templates that support tools
        render into the prompt. Messages with ``tool_calls`` are refused by a template
        that never mentions them: it would drop them without a word. ``template_kwargs``
        (the request's ``chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``) are
        more variables for the template; they may not replace the ones set here.
        ``continue_final_message``: the text ends where the last message's content ends
        (its end-of-turn markup cut), so the model continues that message, as
        transformers cuts it. OpenAI's ``developer`` role is ``system`` to a template
        that never names it (Qwen3's, DeepSeek's and GLM's dropped such a message without
        a word; Llama's wrote a header it was not trained on)."""
        source = self.template_for(tools)
        if source is None:
            if not self.has_chat_template:
                raise TokenizerError("this model has no chat template; use the completions API")
            names = ", ".join(sorted(str(name) for name in self.chat_templates))
            raise TokenizerError(f"this model's chat templates ({names}) include no default")
        if "developer" not in source:
            messages = [{**m, "role": "system"} if m.get("role") == "developer" else m
                        for m in messages]  # fmt: skip
        if any(m.get("tool_calls") for m in messages) and "tool_calls" not in source:
            raise TokenizerError("this model's chat template does not render tool calls")
        template = self._template(source)
        variables = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "tools": tools,
            "documents": None,
            "bos_token": "",
            "eos_token": "",
            **self.special_tokens,
        }
        # Nor the environment's functions (raise_exception, namespace, ...), which a
        # template may call.
        reserved = set(variables) | set(self._environment.globals)
        taken = sorted(set(template_kwargs or ()) & reserved)
        if taken:
            raise TokenizerError(
                f"chat_template_kwargs may not set {', '.join(taken)}", "chat_template_kwargs"
            )
        if continue_final_message:
            variables["messages"] = _tagged_final_message(messages)
        try:
            text = template.render(**(template_kwargs or {}), **variables)
        except Exception as exc:  # the template's own checks, or its code failing on input
            raise TokenizerError(f"the chat template rejected the messages: {exc}") from exc
        return _cut_at_tag(text, messages[-1]["content"]) if continue_final_message else text

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        max_tokens: int | None = None,
        kept: KeptTokens | None = None,
        rewrite: Callable[[str], str] | None = None,
        escape_special: bool = False,
        keep_special: frozenset[str] = frozenset(),
    ) -> list[int]:
        """Render the model's own template and tokenize it (special tokens come from it).
        ``max_tokens`` and ``kept``: as ``encode``'s. ``rewrite``: what the rendered text
        goes through before it is tokenized (a vision model's images: its exceptions
        propagate). ``escape_special``: text in the messages and tools that spells a
        special token, but the texts of ``keep_special``, is encoded as that text
        (``escape_special``), as is such text in the template's arguments (a client's
        ``chat_template_kwargs``) and in tool calls' arguments: only the template writes
        tokens."""
        template = self.template_for(tools)
        if escape_special:  # (everything the client wrote that the template prints)
            messages = self.escape_special(messages, keep_special, template)
            tools = self.escape_special(tools, keep_special, template)
            template_kwargs = self.escape_special(template_kwargs, keep_special, template)
        text = self.render_chat(
            messages, add_generation_prompt, tools, template_kwargs, continue_final_message
        )
        if rewrite is not None:
            text = rewrite(text)
        if not _unicode(text):  # (tokenizers raised a TypeError: a 500)
            raise TokenizerError(
                "the messages hold a lone surrogate (a \\ud800-style escape), which is not "
                "text; a tool call's JSON arguments may hold it"
            )
        if escape_special and (_MARK_START in text or _MARK_END in text):
            # (the caller truncates to ``kept``)
            return self._encode_escaped(text, self._control(template), max_tokens)
        return self.encode(text, add_special_tokens=False, max_tokens=max_tokens, kept=kept)


def _unicode(text: str) -> bool:
    """Whether ``text`` is Unicode (no lone surrogate, which UTF-8 cannot encode). Request
    bodies are checked where they are read; a tool call's arguments are JSON text there,
    and parsed for the template they may hold one."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


# transformers' way to find where the last message's content ends in the rendered text:
# render it with this tag after the content, cut at the tag. Searching for the content
# itself found it inside later markup (a final "end" inside ChatML's "<|im_end|>").
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tagged_final_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the tag after the last one's text content."""
    content = messages[-1].get("content") if messages else None
    if not isinstance(content, str):
        raise TokenizerError(
            "continue_final_message needs a last message with text to continue",
            "continue_final_message",
        )
    return [*messages[:-1], {**messages[-1], "content": content + _CONTINUE_TAG}]


def _cut_at_tag(text: str, content: str) -> str:
    """``text`` (rendered with the tag) up to where the last message's content ends; where
    the template trimmed the tag's trailing space, the content's trailing space went too."""
    tag = _CONTINUE_TAG.strip()
    # Past its last marked control token: a template that splits the content at one
    # (Qwen3's at "</think>") gets the markers where the pieces meet, and they keep its
    # strip()s from trimming there, so the whole content rendered otherwise (a 400).
    tail = content.rsplit(_MARK_END, 1)[-1].strip()
    if tag not in text or tail not in text:
        raise TokenizerError(
            "continue_final_message: the chat template does not render the last message's "
            "content as given",
            "continue_final_message",
        )
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()
