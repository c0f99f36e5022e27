"""The request schemas of the pooling endpoints: OpenAI's ``/v1/embeddings``, vLLM's
``/v1/score`` and ``/v1/rerank`` (Jina's and Cohere's shape). Their shared rules
(``Body``: unknown fields ignored, ``null`` as the default, refused extensions) are
``router/protocol.py``'s."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from router.protocol import (
    INT32_MAX,
    INT32_MIN,
    Body,
    CacheSalt,
    FieldError,
    Prompts,
    absent,
)

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on the inputs of one embeddings request


class EmbeddingRequest(Body):
    """OpenAI's ``POST /v1/embeddings`` body, with vLLM's extensions that apply: each
    input's embedding is its last token's hidden state (``engine/pooling.py``). vLLM's
    other encodings of base64 (``embed_dtype``, ``endianness``) are refused unless they
    name what is sent (float32, little-endian): a client would decode them wrong."""

    REFUSED_EXTRAS: ClassVar[dict[str, Callable[[Any], bool]]] = {
        "embed_dtype": lambda value: value in (None, "float32"),
        "endianness": lambda value: value in (None, "native", "little"),
    }

    model: str | None = None
    # Strict: "1", true and 1.0 are not token ids (pydantic's lax mode took them).
    input: Prompts
    encoding_format: Literal["float", "base64"] = "float"
    # Matryoshka truncation: not offered (a model not trained for it gives meaningless
    # vectors cut short, and none of ours says it was).
    dimensions: int | None = None
    user: str | None = None
    # vLLM's: unit length (the default), or the raw hidden state.
    normalize: bool = True
    add_special_tokens: bool = True
    cache_salt: CacheSalt = None
    priority: int = Field(default=0, ge=INT32_MIN, le=INT32_MAX)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    truncation_side: Literal["left", "right"] | None = None

    @model_validator(mode="after")
    def _checks(self) -> EmbeddingRequest:
        if self.dimensions is not None:
            raise FieldError("dimensions is not supported: embeddings have the model's hidden "
                             "size; leave it unset", "dimensions")  # fmt: skip
        inputs = [self.input] if isinstance(self.input, str) else self.input
        if not inputs or any(isinstance(item, str | list) and not item for item in inputs):
            raise FieldError("input must not be empty (nor any of its items)", "input")
        if len(inputs) > MAX_EMBEDDING_INPUTS and not all(isinstance(i, int) for i in inputs):
            raise FieldError(f"input holds {len(inputs)} items; at most "
                             f"{MAX_EMBEDDING_INPUTS} per request", "input")  # fmt: skip
        if self.truncate_prompt_tokens == 0:
            raise FieldError("truncate_prompt_tokens must be >= 1 (tokens kept) or -1 "
                             "(max_model_len of them)", "truncate_prompt_tokens")  # fmt: skip
        return self


class _ScoringFields(Body):
    """What ``/v1/score`` and ``/v1/rerank`` share (``router/scoring.py``): texts only,
    none empty, at most ``MAX_EMBEDDING_INPUTS`` pairs, and the embeddings' extensions
    that apply to every prompt they make. Refused unless absent (or asking for what is
    done anyway): vLLM's raw-logit switches and per-request label tokens (the scores are
    probabilities of the configured tokens), and Cohere's per-document limits and
    structured-document fields."""

    REFUSED_EXTRAS: ClassVar[dict[str, Callable[[Any], bool]]] = {
        **dict.fromkeys(("use_activation", "activation", "softmax"),
                        lambda value: value in (None, True)),
        **dict.fromkeys(("label_token_ids", "mm_processor_kwargs", "max_tokens_per_doc",
                         "rank_fields", "max_chunks_per_doc"), absent),
    }  # fmt: skip

    model: str | None = None
    add_special_tokens: bool = True
    cache_salt: CacheSalt = None
    priority: int = Field(default=0, ge=INT32_MIN, le=INT32_MAX)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    truncation_side: Literal["left", "right"] | None = None
    user: str | None = None

    def _check_texts(self, **fields: str | list[str]) -> None:
        for name, value in fields.items():
            texts = [value] if isinstance(value, str) else value
            if not texts or not all(texts):
                raise FieldError(f"{name} must not be empty (nor any of its texts)", name)
            if len(texts) > MAX_EMBEDDING_INPUTS:
                raise FieldError(f"{name} holds {len(texts)} texts; at most "
                                 f"{MAX_EMBEDDING_INPUTS} per request", name)  # fmt: skip
        if self.truncate_prompt_tokens == 0:
            raise FieldError("truncate_prompt_tokens must be >= 1 (tokens kept) or -1 "
                             "(max_model_len of them)", "truncate_prompt_tokens")  # fmt: skip


# The names vLLM's ``/score`` has given its two sides, each pair served: the first is
# the query side (one text, or as many as the second side's, paired in order).
SCORE_SIDES = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"),
               ("data_1", "data_2"))  # fmt: skip
_SIDE_NAMES = tuple(dict.fromkeys(name for pair in SCORE_SIDES for name in pair))


class ScoreRequest(_ScoringFields):
    """vLLM's ``POST /v1/score``: the query side against the document side, one text
    against each of a list, or two lists of one length pairwise. The sides come under
    one of the ``SCORE_SIDES`` namings (``text_1``/``text_2`` in older vLLM,
    ``queries``/``documents`` in newer); ``sides`` says which, so that errors name the
    fields the client sent."""

    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None

    @property
    def sides(self) -> tuple[str, str]:
        """The names the two sides came under, query side first."""
        given = {name for name in _SIDE_NAMES if getattr(self, name) is not None}
        for pair in SCORE_SIDES:
            if given == set(pair):
                return pair
        raise FieldError(*_sides_error(given))

    def texts(self) -> tuple[str | list[str], str | list[str]]:
        """The query side's text(s) and the document side's."""
        first, second = self.sides
        return getattr(self, first), getattr(self, second)

    @model_validator(mode="after")
    def _checks(self) -> ScoreRequest:
        first, second = self.sides
        self._check_texts(**{first: getattr(self, first), second: getattr(self, second)})
        return self


def _sides_error(given: set[str]) -> tuple[str, str]:
    """Why ``given`` (the side fields present) name no pair, and the field to blame: a
    field stray from the naming most of them are in, else that naming's missing half."""
    namings = ", ".join(f"{first} and {second}" for first, second in SCORE_SIDES)
    if not given:
        return f"the request needs the two sides to score: {namings}", "text_1"
    best = max(SCORE_SIDES, key=lambda pair: len(given & set(pair)))  # the first of a tie
    stray = sorted(given - set(best))
    if stray:
        return f"give the two sides under one naming ({namings}); got {sorted(given)}", stray[0]
    missing, present = (best[1], best[0]) if best[0] in given else best
    return f"{missing} is required with {present}", missing


class TextDocument(Body):
    """A document as Jina's and Cohere v1's clients may send it: ``{"text": ...}``."""

    text: str


class RerankRequest(_ScoringFields):
    """``POST /v1/rerank`` (Jina's and Cohere's shape, as vLLM serves it): ``documents``
    (texts, or ``{"text": ...}`` objects) by relevance to ``query``, the ``top_n`` best
    (0: all)."""

    query: str
    documents: list[str | TextDocument]
    top_n: int = Field(default=0, ge=0)
    return_documents: bool = True  # Jina's and Cohere v1's: each result's text back

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]

    @model_validator(mode="after")
    def _checks(self) -> RerankRequest:
        self._check_texts(query=self.query, documents=self.texts())
        return self
