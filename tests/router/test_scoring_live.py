"""A causal LM as a reranker through the whole stack (``router.score_method:
token_logits``): each (query, document) prompt is the template filled in, its score the
positive token's probability from the offline engine's logits, and a query's pairs share
their prefix in the workers' caches."""

from __future__ import annotations

import math

import httpx
import pytest

from common.tokenizer import Tokenizer
from engine import LLM, PoolingParams
from tests.support.polling import eventually
from tests.support.processes import write_config
from tests.support.stack import serving, worker_stats

TEMPLATE = "Judge the document.\nQuery: {query}\nDocument: {document}\nAnswer:"
TOKENS = ("no", "ok")  # each one token of the tiny model's vocabulary (ids 557, 800)


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scoring")
    router = {"min_disagg_tokens": 0, "score_method": "token_logits",
              "score_tokens": list(TOKENS), "score_template": TEMPLATE}  # fmt: skip
    config = write_config(tmp / "config.yaml", tiny_llama, router=router)
    with serving(config, tmp / "home") as stack:
        yield stack


def post(stack, path: str, body: dict) -> dict:
    reply = httpx.post(f"{stack.base_url}{path}", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def offline_scores(model_dir, pairs: list[tuple[str, str]]) -> tuple[list[float], int]:
    """The positive token's probability after each filled-in prompt, from the offline
    engine's logits; and the prompts' tokens."""
    tokenizer = Tokenizer(model_dir)
    ids = tuple(tokenizer.encode(token, add_special_tokens=False)[0] for token in TOKENS)
    prompts = [
        tokenizer.encode(TEMPLATE.replace("{query}", q).replace("{document}", d)) for q, d in pairs
    ]
    outputs = LLM(model_dir).embed(prompts, PoolingParams(token_ids=ids), use_tqdm=False)
    scores = []
    for output in outputs:
        negative, positive = output.embedding.tolist()
        scores.append(1 / (1 + math.exp(negative - positive)))
    return scores, sum(map(len, prompts))


def test_rerank_and_score_read_the_models_yes_no_logits(stack, tiny_llama):
    query = "which city is the capital of france, and what river runs through it " * 2
    documents = ["paris is the capital of france", "the seine runs through paris",
                 "cats sleep a lot", "lyon is a city in france"]  # fmt: skip
    expected, num_tokens = offline_scores(tiny_llama, [(query, d) for d in documents])

    def hits() -> int:
        return sum(s.prefix_hit_tokens for s in worker_stats(stack, "prefill"))

    before = hits()
    reranked = post(stack, "/v1/rerank", {"query": query, "documents": documents})
    order = sorted(range(len(documents)), key=lambda i: -expected[i])
    assert [r["index"] for r in reranked["results"]] == order
    assert [r["relevance_score"] for r in reranked["results"]] == pytest.approx(
        [expected[i] for i in order], abs=1e-5)  # fmt: skip
    assert all(0.0 < r["relevance_score"] < 1.0 for r in reranked["results"])
    assert reranked["usage"]["total_tokens"] == num_tokens
    # The pairs share the template's head and the query (several blocks): computed once
    # on the prefill worker, hit by the other pairs (some run at once, before it is cached).
    assert eventually(lambda: hits() - before >= 16)
    pairs = [("a short query", "a document"), (query, documents[1])]
    pair_scores, _ = offline_scores(tiny_llama, pairs)
    scored = post(stack, "/v1/score", {"text_1": [q for q, _ in pairs],
                                       "text_2": [d for _, d in pairs]})  # fmt: skip
    assert [item["score"] for item in scored["data"]] == pytest.approx(pair_scores, abs=1e-5)


def test_a_document_past_the_context_is_cut_to_fit_with_the_template_whole(stack, tiny_llama):
    """``truncate_prompt_tokens`` under ``token_logits`` cuts the document's end, not the
    prompt's head or tail: the score is the offline engine's on the prompt that fits.
    Without it the pair is a 400 naming ``documents``."""
    from common.router_config import RouterConfig
    from router.scoring import Scorer

    tokenizer = Tokenizer(tiny_llama)
    scorer = Scorer.build(RouterConfig(score_method="token_logits", score_tokens=TOKENS,
                                       score_template=TEMPLATE), tokenizer, tiny_llama)  # fmt: skip
    query, document = "where does the seine run", "the seine runs through paris. " * 200
    body = {"query": query, "documents": [document, "a short one"]}
    refused = httpx.post(f"{stack.base_url}/v1/rerank", json=body, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "documents"
    # No room for any document: named as the truncation's fault, not the context's.
    for keep in (1, 5):
        no_room = httpx.post(
            f"{stack.base_url}/v1/rerank", timeout=60, json={**body, "truncate_prompt_tokens": keep}
        ).json()["error"]
        assert no_room["param"] == "truncate_prompt_tokens", no_room
        assert "the template and the query alone" in no_room["message"]
    # A query too long with the template around it is the query's fault.
    long_query = httpx.post(
        f"{stack.base_url}/v1/rerank", timeout=60, json={**body, "query": "where " * 1020}
    ).json()["error"]
    assert long_query["param"] == "query", long_query
    for keep, limit in ((-1, 1024), (300, 300)):  # write_config's max_model_len: 1024
        reranked = post(stack, "/v1/rerank", {**body, "truncate_prompt_tokens": keep})
        fitted = scorer.fit_documents(tokenizer, [(query, document)], limit, True)
        expected, num_tokens = offline_scores(tiny_llama, [*fitted, (query, "a short one")])
        assert limit - 4 <= num_tokens - len(tokenizer.encode(scorer.prompt_text(
            query, "a short one"))) <= limit  # fmt: skip
        scores = {r["index"]: r["relevance_score"] for r in reranked["results"]}
        assert [scores[0], scores[1]] == pytest.approx(expected, abs=1e-5)
        assert reranked["usage"]["total_tokens"] == num_tokens
