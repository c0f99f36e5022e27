"""router/scoring.py: pairing, prompts, the scores from vectors, and the config's checks."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from common.config_base import ConfigError
from common.router_config import RouterConfig, ScoreMethod
from common.tokenizer import Tokenizer
from router.scoring import (
    EMBEDDING_SCORER,
    NoRoomForDocument,
    Scorer,
    pairs_of,
    rerank_document,
    score_document,
)
from tests.engine.helpers import headless_copy

TOKEN_LOGITS = {"score_method": "token_logits", "score_tokens": ("no", "ok")}


def test_pairs_broadcast_one_text_or_pair_two_lists_in_order():
    assert pairs_of("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert pairs_of(["q"], "a") == [("q", "a")]
    assert pairs_of(["q", "r"], ["a", "b"]) == [("q", "a"), ("r", "b")]
    with pytest.raises(ValueError, match="text_1 holds 2 texts and text_2 3"):
        pairs_of(["q", "r"], ["a", "b", "c"])
    with pytest.raises(ValueError, match="queries holds 2 texts and items 3: give one queries"):
        pairs_of(["q", "r"], ["a", "b", "c"], ("queries", "items"))


def test_embedding_scores_embed_each_distinct_text_once_and_take_dot_products():
    pairs = [("q", "a"), ("q", "b"), ("a", "q")]
    plan = EMBEDDING_SCORER.plan(pairs)
    assert plan.texts == ["q", "a", "b"] and EMBEDDING_SCORER.normalize
    rng = np.random.default_rng(0)
    vectors = [v / np.linalg.norm(v) for v in rng.standard_normal((3, 8)).astype(np.float32)]
    q, a, b = vectors
    expected = [float(q @ a), float(q @ b), float(a @ q)]
    assert plan.combine(vectors) == pytest.approx(expected, abs=1e-6)
    # A text against itself: 1 at most, though float32 rounding can put it above.
    ones = [np.full(3, 0.5774, np.float32)] * 3  # norm 1.00003
    assert plan.combine(ones) == [1.0, 1.0, 1.0]


def test_token_logits_fill_the_template_once_per_pair_and_read_probabilities(tiny_llama):
    config = RouterConfig(**TOKEN_LOGITS, score_template="Q: {query}\nD: {document}\nA:")
    scorer = Scorer.build(config, Tokenizer(tiny_llama), tiny_llama)
    assert scorer.token_ids == (557, 800) and not scorer.normalize
    # One pass: a query holding "{document}" keeps it.
    assert scorer.prompt_text("is {document}?", "x") == "Q: is {document}?\nD: x\nA:"
    plan = scorer.plan([("q", "a"), ("q", "b")])
    assert plan.texts == ["Q: q\nD: a\nA:", "Q: q\nD: b\nA:"]
    logits = [np.array([1.0, 3.0], np.float32), np.array([2.0, -1.0], np.float32)]
    sigmoid = [1 / (1 + math.exp(-2.0)), 1 / (1 + math.exp(3.0))]  # of positive - negative
    assert plan.combine(logits) == pytest.approx(sigmoid)
    softmax = np.exp(logits[0]) / np.exp(logits[0]).sum()
    assert plan.combine(logits)[0] == pytest.approx(softmax[1])  # the same reading
    # One token: its logit's sigmoid; margins past exp's range do not overflow.
    one = Scorer(ScoreMethod.TOKEN_LOGITS, "{query}{document}", (800,))
    assert one.relevance(np.array([0.5], np.float32)) == pytest.approx(1 / (1 + math.exp(-0.5)))
    assert one.relevance(np.array([-1e4], np.float32)) == 0.0
    assert scorer.relevance(np.array([-1e4, 1e4], np.float32)) == 1.0


def test_score_tokens_must_each_be_one_token(tiny_llama):
    config = RouterConfig(score_method="token_logits", score_tokens=("no", "yes"))
    with pytest.raises(ConfigError, match="'yes' is 2 tokens") as raised:
        Scorer.build(config, Tokenizer(tiny_llama), tiny_llama)
    assert raised.value.key == "router.score_tokens"


@pytest.mark.parametrize(
    ("fields", "key", "words"),
    [
        ({"score_method": "token_logits"}, "router.score_tokens", "1 token"),
        ({**TOKEN_LOGITS, "score_tokens": ("a", "b", "c")}, "router.score_tokens", "or 2"),
        ({**TOKEN_LOGITS, "score_tokens": ("ok", "ok")}, "router.score_tokens", "must differ"),
        ({**TOKEN_LOGITS, "score_template": "{query} only"}, "router.score_template",
         "{document}"),
        ({"score_tokens": ("no",)}, "router.score_method", "token_logits only"),
        ({"score_template": "{query}: {document}"}, "router.score_method", "token_logits only"),
        ({"score_method": "cosine"}, "score_method", "embedding, token_logits"),
    ],
)  # fmt: skip
def test_the_config_refuses_what_could_not_score(fields, key, words):
    with pytest.raises(ConfigError) as raised:
        RouterConfig(**fields)
    assert raised.value.key == key and words in str(raised.value)


def test_truncation_cuts_the_document_and_keeps_the_template_and_query(tiny_llama):
    tokenizer = Tokenizer(tiny_llama)
    config = RouterConfig(**TOKEN_LOGITS, score_template="Judge.\nQ: {query}\nD: {document}\nA:")
    scorer = Scorer.build(config, tokenizer, tiny_llama)
    query, document = "where is the river", "the seine runs through paris, " * 20
    short = ("q", "a short document")
    fitted = scorer.fit_documents(tokenizer, [(query, document), short], 40, True)
    assert fitted[1] == short  # fits already: unchanged
    (q, d), _ = fitted
    assert q == query and document.startswith(d.rstrip()) and len(d) < len(document)
    prompt = tokenizer.encode(scorer.prompt_text(q, d))
    assert 36 <= len(prompt) <= 40  # cut to fit, not far below
    assert scorer.prompt_text(q, d).startswith(f"Judge.\nQ: {query}\nD: ")
    assert scorer.prompt_text(q, d).endswith("\nA:")
    with pytest.raises(NoRoomForDocument, match="the template and the query alone"):
        scorer.fit_documents(tokenizer, [("a long query " * 20, "d")], 40, True)


def test_rerank_results_go_best_first_ties_in_input_order_the_top_n_kept():
    scores = [0.2, 0.9, 0.2, 0.5]
    document = rerank_document("r", scores, 12, "m", ["a", "b", "c", "d"], top_n=3)
    assert [r["index"] for r in document["results"]] == [1, 3, 0]  # 0 before 2 (a tie)
    assert [r["document"]["text"] for r in document["results"]] == ["b", "d", "a"]
    assert document["usage"] == {"prompt_tokens": 12, "total_tokens": 12}
    assert document["model"] == "m"
    everything = rerank_document("r", scores, 12, "m", None, top_n=0)
    assert [r["index"] for r in everything["results"]] == [1, 3, 0, 2]
    assert all(set(r) == {"index", "relevance_score"} for r in everything["results"])
    assert len(rerank_document("r", scores, 12, "m", None, top_n=99)["results"]) == 4
    scored = score_document("s", [0.5, 0.1], 7, "m")
    assert [(d["index"], d["score"]) for d in scored["data"]] == [(0, 0.5), (1, 0.1)]
    assert scored["usage"] == {"prompt_tokens": 7, "total_tokens": 7, "completion_tokens": 0}


def test_identical_pairs_are_computed_once_and_tie(tiny_llama):
    scorer = Scorer.build(RouterConfig(**TOKEN_LOGITS), Tokenizer(tiny_llama), tiny_llama)
    plan = scorer.plan([("q", "a"), ("q", "b"), ("q", "a")])
    assert plan.texts == ["qa", "qb"]
    logits = [np.array([0.0, 1.0], np.float32), np.array([1.0, 0.0], np.float32)]
    first, second, again = plan.combine(logits)
    assert first == again != second


def test_truncation_reads_a_bounded_prefix_of_a_huge_document(tiny_llama):
    """A 4 MB document cut to 40 tokens: only its head is tokenized (fast), and the result
    is what cutting the whole would give."""
    tokenizer = Tokenizer(tiny_llama)
    scorer = Scorer.build(RouterConfig(**TOKEN_LOGITS), tokenizer, tiny_llama)
    huge = "the seine runs through paris, " * 140_000
    start = time.perf_counter()
    ((_, document),) = scorer.fit_documents(tokenizer, [("where", huge)], 40, True)
    assert time.perf_counter() - start < 2.0  # whole, it takes seconds and gigabytes
    ((_, small),) = scorer.fit_documents(tokenizer, [("where", huge[:5000])], 40, True)
    assert document == small and len(tokenizer.encode(scorer.prompt_text("where", document))) <= 40


def test_token_logits_on_a_checkpoint_without_a_head_is_a_config_error(model_factory, tmp_path):
    """A backbone saved alone (Qwen3-Embedding's layout) has no logits to read: refused at
    start, named; the full checkpoint and embedding scoring of the bare one are fine."""
    full = model_factory("qwen3")
    bare = headless_copy(full, tmp_path / "bare")
    config = RouterConfig(**TOKEN_LOGITS)
    with pytest.raises(ConfigError, match="has no language-model head") as raised:
        Scorer.build(config, Tokenizer(bare), bare)
    assert raised.value.key == "router.score_method"
    assert Scorer.build(RouterConfig(), Tokenizer(bare), bare) == EMBEDDING_SCORER
    assert Scorer.build(config, Tokenizer(full), full).method is ScoreMethod.TOKEN_LOGITS
