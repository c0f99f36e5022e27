"""``/v1/score`` and ``/v1/rerank``: how relevant each document is to its query, by the
method the config names (``router.score_method``).

``embedding`` (the default): every distinct text is embedded once, at unit length
(``router/embeddings.py``), and a pair's score is the dot product of its two vectors, their
cosine similarity in [-1, 1]. A query against 100 documents is 101 embeddings, not 200.
What vLLM's score API does for an embedding model (Qwen3-Embedding, gte-Qwen2).

``token_logits``: a causal LM that reads a (query, document) prompt and answers yes or no
(Qwen3-Reranker, bge-reranker-v2-gemma). Each pair is one prompt, ``score_template`` with
the two texts filled in; the engine returns the last token's logits at ``score_tokens``
(``engine/pooling.py``), and the score is the positive token's probability: with two tokens
(negative, positive) their softmax, ``sigmoid(positive - negative)``; with one, its logit's
sigmoid. Scores are in [0, 1], as the models' own reference code computes them. A template
that puts the query first makes a query's pairs share their prefix: placement sends them
where it is cached, and each worker computes it once.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.config_base import ConfigError
from common.model_info import serves_embeddings_only
from common.router_config import DEFAULT_SCORE_TEMPLATE, RouterConfig, ScoreMethod
from common.tokenizer import KeptTokens, Tokenizer

_FIELD = re.compile(r"\{(query|document)\}")


@dataclass(frozen=True, slots=True)
class ScorePlan:
    """What to compute for a list of pairs: ``texts``, one engine request each, and
    ``combine``, which turns their vectors (float32, in ``texts`` order) into one score per
    pair."""

    texts: list[str]
    combine: Callable[[list[np.ndarray]], list[float]]


class NoRoomForDocument(ValueError):
    """The template and the query alone pass the tokens a prompt may have."""


@dataclass(frozen=True, slots=True)
class Scorer:
    """How a (query, document) pair becomes a score (``router.score_method``): the texts
    to compute (``plan``) and the score of each pair from their vectors."""

    method: ScoreMethod
    template: str
    # token_logits: the ids of score_tokens (negative first, when there are two).
    token_ids: tuple[int, ...]

    @classmethod
    def build(cls, config: RouterConfig, tokenizer: Tokenizer, model_dir: Path) -> Scorer:
        """Raises ``ConfigError`` for a score token that is not one token of this model's
        vocabulary (its logit would be some other token's), and for ``token_logits`` on a
        checkpoint without a language-model head (it has no logits)."""
        if config.score_method is ScoreMethod.TOKEN_LOGITS and serves_embeddings_only(model_dir):
            raise ConfigError("router.score_method", f"token_logits reads the model's logits; "
                              f"{model_dir} has no language-model head (an embedding "
                              "checkpoint): use embedding")  # fmt: skip
        token_ids = []
        for token in config.score_tokens:
            encoded = tokenizer.encode(token, add_special_tokens=False)
            if len(encoded) != 1:
                raise ConfigError("router.score_tokens", f"{token!r} is {len(encoded)} tokens "
                                  "in this model's vocabulary; each must be one")  # fmt: skip
            token_ids.append(encoded[0])
        return cls(config.score_method, config.score_template, tuple(token_ids))

    @property
    def normalize(self) -> bool:
        """Embeddings at unit length (their dot product is then the cosine)."""
        return self.method is ScoreMethod.EMBEDDING

    def prompt_text(self, query: str, document: str) -> str:
        """The template with both texts in, in one pass (a query holding "{document}"
        stays as it is)."""
        return _FIELD.sub(lambda m: query if m[1] == "query" else document, self.template)

    def plan(self, pairs: Sequence[tuple[str, str]]) -> ScorePlan:
        """``token_logits``: each distinct pair's prompt once. ``embedding``: each distinct
        text once. Either way identical inputs score identically: batched elsewhere, the
        same prompt's logits differed in the 7th digit, and duplicates ranked out of input
        order. Builds every prompt: run it off the event loop (2,048 copies of a query)."""
        position: dict[str, int] = {}  # each distinct text once
        if self.method is ScoreMethod.TOKEN_LOGITS:  # identical pairs tie exactly
            prompts = [self.prompt_text(query, document) for query, document in pairs]
            for prompt in prompts:
                position.setdefault(prompt, len(position))
            return ScorePlan(list(position), lambda vectors: [
                self.relevance(vectors[position[prompt]]) for prompt in prompts
            ])  # fmt: skip
        for text in (text for pair in pairs for text in pair):
            position.setdefault(text, len(position))

        def cosines(vectors: list[np.ndarray]) -> list[float]:
            """Clipped: float32 rounding put a text against itself at 1.00000005."""
            return [
                min(1.0, max(-1.0, float(np.dot(vectors[position[q]].astype(np.float64),
                                                vectors[position[d]]))))
                for q, d in pairs
            ]  # fmt: skip

        return ScorePlan(list(position), cosines)

    def fit_documents(
        self,
        tokenizer: Tokenizer,
        pairs: Sequence[tuple[str, str]],
        keep: int,
        add_special_tokens: bool,
    ) -> list[tuple[str, str]]:
        """``token_logits`` truncation: each pair whose filled-in prompt passes ``keep``
        tokens with its document cut from the end until it fits; the template and the
        query stay whole, as the rerankers' reference code truncates (a prompt's last
        tokens alone would cut the template's head, its first ones the tail the answer
        follows). Raises ``NoRoomForDocument`` where the template and the query alone
        pass ``keep``."""

        def length(query: str, document: str) -> int:
            return len(tokenizer.encode(self.prompt_text(query, document), add_special_tokens))

        fitted = []
        for query, document in pairs:
            # Only what truncation can keep is read (a 24 MB document took 25 s whole).
            document = tokenizer.cut_to_kept(document, KeptTokens(keep, from_end=False))
            num_tokens = length(query, document)
            document_ids = []
            if num_tokens > keep:
                document_ids = tokenizer.encode(document, add_special_tokens=False)
            while num_tokens > keep:  # each pass cuts at least one token
                cut = len(document_ids) - (num_tokens - keep)
                if cut <= 0:  # nothing left to cut, or the boundary tokenized longer
                    document = ""
                    if length(query, document) > keep:
                        raise NoRoomForDocument(
                            f"the template and the query alone take "
                            f"more than {keep} tokens: no document fits"
                        )
                    break
                document_ids = document_ids[:cut]
                document = tokenizer.decode(document_ids, skip_special_tokens=False)
                num_tokens = length(query, document)
            fitted.append((query, document))
        return fitted

    def relevance(self, logits: np.ndarray) -> float:
        """The positive token's probability from its logit (and the negative one's)."""
        margin = float(logits[-1]) - (float(logits[0]) if len(logits) == 2 else 0.0)
        return _sigmoid(margin)


EMBEDDING_SCORER = Scorer(ScoreMethod.EMBEDDING, DEFAULT_SCORE_TEMPLATE, ())  # the default


def _sigmoid(x: float) -> float:
    if x >= 0:  # no overflow for any margin
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


def pairs_of(
    queries: str | list[str],
    documents: str | list[str],
    names: tuple[str, str] = ("text_1", "text_2"),
) -> list[tuple[str, str]]:
    """vLLM's pairing of the query side with the document side: one text (or a list of
    one) against each of the other's, or two lists of one length pairwise. Raises
    ``ValueError``, naming the sides as ``names`` do, for lists of different lengths."""
    first = [queries] if isinstance(queries, str) else list(queries)
    second = [documents] if isinstance(documents, str) else list(documents)
    if len(first) == 1:
        return [(first[0], text) for text in second]
    if len(first) != len(second):
        one, other = names
        raise ValueError(f"{one} holds {len(first)} texts and {other} {len(second)}: give "
                         f"one {one}, or as many as {other} (paired in order)")  # fmt: skip
    return list(zip(first, second, strict=True))


def score_document(
    response_id: str, scores: list[float], num_tokens: int, model: str
) -> dict[str, Any]:
    """vLLM's ``/score`` response: one score per pair, in pair order."""
    data = [{"index": i, "object": "score", "score": value} for i, value in enumerate(scores)]
    usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}
    return {"id": response_id, "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": usage}  # fmt: skip


def rerank_document(
    response_id: str,
    scores: list[float],
    num_tokens: int,
    model: str,
    documents: list[str] | None,
    top_n: int,
) -> dict[str, Any]:
    """The rerank response (Jina's, Cohere v1's, vLLM's): results best first, ties in
    input order, the ``top_n`` best (0: all); each with its text when ``documents``."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: ties in order
    results: list[dict[str, Any]] = []
    for index in order[: top_n or len(order)]:
        result: dict[str, Any] = {"index": index, "relevance_score": scores[index]}
        if documents is not None:
            result["document"] = {"text": documents[index]}
        results.append(result)
    usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    return {"id": response_id, "model": model, "usage": usage, "results": results}
