"""The pooling routes: ``/v1/embeddings``, vLLM's ``/v1/score`` and the rerank routes
(Jina's, Cohere's). Each text runs as one pooled request on a worker
(``router/embeddings.py``); how a pair is scored is ``router/scoring.py``'s."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from common.router_config import ScoreMethod
from proto import pdserve_pb2 as pb
from router.admission import GONE, Admission, record_error, until_disconnected
from router.choices import new_id
from router.embeddings import LANES, EmbeddingsBody, check_finite, embed_all
from router.errors import APIError, bad_request, context_too_long, internal, unavailable
from router.json_body import Body
from router.pooling_protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from router.prompts import PromptTokenizer
from router.scoring import NoRoomForDocument, pairs_of, rerank_document, score_document
from router.state import RouterState

logger = logging.getLogger(__name__)


def add_pooling_routes(
    app: FastAPI, state: RouterState, prompt_tokenizer: PromptTokenizer, admission: Admission
) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(body: Body[EmbeddingRequest], request: Request) -> Response:
        """Each input's embedding: its last token's hidden state, from whichever worker
        placement picks (``router/embeddings.py``)."""
        lora_name = admission.lora_name(body.model)
        check_pooling(body)
        check_last_token_pooling()
        response_id = new_id("embd")
        done = await pooled(request, body, body.input, "input", lora_name, response_id,
                            normalize=body.normalize)  # fmt: skip
        if done is None:
            return Response(status_code=499)  # nobody is listening; the work is aborted
        prompts, replies = done
        name = lora_name or state.model.served_name
        num_tokens = sum(map(len, prompts))
        if body.encoding_format == "float":  # (base64 carries any float32 bits)
            check_finite([reply.embedding for reply in replies], "embeddings")
        document = EmbeddingsBody(response_id, name, replies, num_tokens, body.encoding_format)
        if document.small:
            return Response(document.whole(), media_type="application/json")
        return StreamingResponse(document.pieces(), media_type="application/json")

    @app.post("/v1/score")
    @app.post("/score")
    async def score(body: Body[ScoreRequest], request: Request) -> Response:
        """vLLM's score API: each (query, document) pair's relevance, by the configured
        method (``router/scoring.py``); the sides under any of vLLM's namings."""
        sides = body.sides
        try:
            pairs = pairs_of(*body.texts(), sides)
        except ValueError as exc:
            raise bad_request(str(exc), sides[1]) from None
        response_id = new_id("score")
        scored = await score_pairs(request, body, pairs, sides, response_id)
        if scored is None:
            return Response(status_code=499)
        return JSONResponse(score_document(response_id, *scored))

    @app.post("/v1/rerank")
    @app.post("/rerank")
    @app.post("/v2/rerank")
    async def rerank(body: Body[RerankRequest], request: Request) -> Response:
        """Jina's and Cohere's rerank (as vLLM serves it): the documents by relevance to
        the query, best first, the ``top_n`` best (0: all)."""
        documents = body.texts()
        pairs = [(body.query, document) for document in documents]
        response_id = new_id("rerank")
        scored = await score_pairs(request, body, pairs, ("query", "documents"), response_id)
        if scored is None:
            return Response(status_code=499)
        shown = documents if body.return_documents else None
        return JSONResponse(rerank_document(response_id, *scored, shown, body.top_n))

    def check_pooling(body: EmbeddingRequest | ScoreRequest | RerankRequest) -> None:
        admission.check_open()
        admission.check_priority(body.priority)

    def check_last_token_pooling() -> None:
        """The engine pools the last token (``engine/pooling.py``): a checkpoint whose
        sentence-transformers config pools otherwise got last-token vectors, silently
        (an audit: a mean-pooled model's vectors were off by 0.27)."""
        foreign = state.model.foreign_pooling
        if foreign is not None:
            raise bad_request(
                f"this model's sentence-transformers config {foreign} (modules.json); "
                "pdserve embeds a prompt as its last token's hidden state, which would "
                "not be this model's embedding",
                "model",
            )

    async def score_pairs(
        request: Request,
        body: ScoreRequest | RerankRequest,
        pairs: list[tuple[str, str]],
        params: tuple[str, str],
        response_id: str,
    ) -> tuple[list[float], int, str] | None:
        """Each pair's score, the prompt tokens computed and the model's name; None when
        the client left first. ``params`` name the query's field and the document's, for
        errors. The texts computed run as ``<response_id>-<i>``."""
        lora_name = admission.lora_name(body.model)
        check_pooling(body)
        scorer = state.scorer
        query_param, document_param = params
        logits = scorer.method is ScoreMethod.TOKEN_LOGITS
        if not logits:
            check_last_token_pooling()
        truncating = body.truncate_prompt_tokens is not None
        if logits or not truncating:  # each query fits, before 2,048 prompts copy it
            queries = list(dict.fromkeys(query for query, _ in pairs))
            if logits:  # with the template around it (an empty document)
                queries = [scorer.prompt_text(query, "") for query in queries]
            await asyncio.to_thread(prompt_tokenizer.ids, queries, query_param,
                                    state.model.max_model_len,
                                    body.add_special_tokens)  # fmt: skip
        fit = logits and truncating
        if fit:  # the documents are cut, not the prompts (``Scorer.fit_documents``)
            keep = prompt_tokenizer.keep(body.truncate_prompt_tokens)
            try:
                pairs = await asyncio.to_thread(scorer.fit_documents, state.tokenizer, pairs,
                                                keep, body.add_special_tokens)  # fmt: skip
            except NoRoomForDocument as exc:
                raise bad_request(str(exc), "truncate_prompt_tokens") from None
        plan = await asyncio.to_thread(scorer.plan, pairs)
        done = await pooled(request, body, plan.texts, document_param, lora_name, response_id,
                            normalize=scorer.normalize, logit_token_ids=scorer.token_ids,
                            truncate=not fit)  # fmt: skip
        if done is None:
            return None
        prompts, replies = done
        check_finite([reply.embedding for reply in replies], "scores")
        vectors = [np.frombuffer(reply.embedding, dtype="<f4") for reply in replies]
        expected = len(scorer.token_ids) if logits else len(vectors[0])
        if any(len(vector) != expected or not expected for vector in vectors):
            # A worker from before logit_token_ids (mid-upgrade) sends a hidden state.
            sizes = sorted({len(vector) for vector in vectors})
            logger.warning("request %s: vectors of %s floats, %d expected", response_id,
                           sizes, expected)  # fmt: skip
            raise unavailable(
                f"a worker answered with vectors of {sizes} floats where "
                f"{expected} were asked for (a worker of an older version?)"
            )
        name = lora_name or state.model.served_name
        return plan.combine(vectors), sum(map(len, prompts)), name

    async def pooled(
        request: Request,
        body: EmbeddingRequest | ScoreRequest | RerankRequest,
        value: str | list,
        param: str,
        lora_name: str | None,
        response_id: str,
        *,
        normalize: bool,
        logit_token_ids: tuple[int, ...] = (),
        truncate: bool = True,
    ) -> tuple[list[list[int]], list[pb.EmbedResponse]] | None:
        """``value``'s prompts (texts or ids, blaming ``param``) and each one's ``Embed``
        reply, in order; None when the client left first (the work is then aborted).
        ``truncate``: apply the body's ``truncate_prompt_tokens`` (False: done before)."""
        truncating = truncate and body.truncate_prompt_tokens is not None
        limit = None if truncating else state.model.max_model_len
        kept = prompt_tokenizer.window(body) if truncating else None
        prompts = await asyncio.to_thread(prompt_tokenizer.ids, value, param, limit,
                                          body.add_special_tokens, kept)  # fmt: skip
        if kept is not None:
            prompts = [kept.ids(prompt) for prompt in prompts]
        max_model_len = state.model.max_model_len
        for tokens in prompts:
            if len(tokens) > max_model_len:
                raise context_too_long(len(tokens), None, max_model_len, param)
        if await request.is_disconnected():  # it left while its texts were tokenized
            return None
        lora = state.adapters.resolve(lora_name) if lora_name is not None else None
        # Its calls in flight are its sequences (``router/embeddings.py``).
        lanes = min(len(prompts), LANES, state.config.router.max_inflight_sequences)
        release = admission.admit(lanes, lora_name)
        span = admission.span(request, response_id, lora_name, len(prompts))
        span.set({"gen_ai.usage.input_tokens": sum(map(len, prompts))})
        try:
            work = embed_all(state.dispatcher, prompts, response_id, state.model.block_size,
                             lora, body, lanes, normalize=normalize,
                             logit_token_ids=logit_token_ids,
                             trace_headers=span.headers)  # fmt: skip
            replies = await until_disconnected(request, work, lambda: state.stopping)
            if replies is GONE:
                span.set({"pdserve.cancelled": True})
        except BaseException as exc:
            record_error(span, exc)
            if isinstance(exc, APIError) or not isinstance(exc, Exception):
                raise
            logger.exception("request %s failed", response_id)
            raise internal(response_id) from None
        finally:
            release()
            span.end()
        return None if replies is GONE else (prompts, replies)
