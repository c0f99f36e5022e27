"""The checks ``LLMEngine.add_request`` makes of a request before it touches the engine.

Each raises ``InvalidRequestError`` naming the offending parameter, and reads only what it
is given (no engine state), so a check is testable alone and the engine's ``add_request``
reads as check → build → queue. The router checks much of this too, but an engine must
not trust its callers: a script, an old router, or the offline ``LLM`` reach it directly.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.intmath import cdiv
from engine.errors import InvalidRequestError
from engine.pooling import EMBEDDING_SAMPLING, PoolingParams
from engine.request import RemoteKV
from engine.sampling_params import SamplingParams


def check_sampling(params: SamplingParams, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
    """One sequence, no text to read, token ids in the vocabulary, and something left to
    sample before ``min_tokens`` once stop ids and EOS are banned."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError("sampling params must be a SamplingParams", "params")
    if params.n != 1 or params.stop:
        raise InvalidRequestError(
            "an engine request is one sequence and reads no text: n and stop are the "
            "offline API's (LLM.generate)",
            "n" if params.n != 1 else "stop",
        )
    for name, token_ids in (
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias", [t for t, _ in params.logit_bias]),
        ("allowed_token_ids", params.allowed_token_ids or ()),
        ("bad_words", [t for word in params.bad_words_token_ids for t in word]),
    ):
        if any(t >= vocab_size for t in token_ids):
            raise InvalidRequestError(f"{name} must be in [0, {vocab_size}) (token ids)", name)
    if not params.min_tokens:
        return
    banned = params.ids_banned_before_min_tokens(eos_token_ids)
    allowed = params.allowed_token_ids
    if allowed is None and len(banned) >= vocab_size:
        raise InvalidRequestError(
            "stop_token_ids and EOS cover the whole vocabulary: nothing could be sampled "
            "before min_tokens",
            "stop_token_ids",
        )
    if allowed is not None and set(allowed) <= banned:
        raise InvalidRequestError(
            "stop_token_ids and EOS cover every allowed_token_ids: nothing could be "
            "sampled before min_tokens",
            "allowed_token_ids",
        )


def check_pooling(
    pooling: PoolingParams | None,
    params: SamplingParams,
    *,
    model_name: str,
    generates: bool,
    vocab_size: int,
    computes_here: bool,
) -> None:
    """A model without a language-model head serves embeddings only; an embedding request
    samples nothing and computes its whole prompt here (``computes_here``: not prefill
    only, no remote KV, no output tokens); its scored token ids need logits and must be
    in the vocabulary."""
    if pooling is None:
        if not generates:
            raise InvalidRequestError(
                f"{model_name} has no language-model head (lm_head.weight), as embedding "
                "checkpoints do: it serves embeddings only",
                "model",
            )
        return
    if params != EMBEDDING_SAMPLING or not computes_here:
        raise InvalidRequestError(
            "an embedding request samples nothing (EMBEDDING_SAMPLING), computes its "
            "whole prompt here and has no output tokens",
            "pooling",
        )
    if not pooling.token_ids:
        return
    if not generates:
        raise InvalidRequestError(
            f"{model_name} has no language-model head: it has no logits to score tokens by",
            "pooling",
        )
    if any(not 0 <= t < vocab_size for t in pooling.token_ids):
        raise InvalidRequestError(f"pooling token ids must be in [0, {vocab_size})", "pooling")


def check_resume(
    num_prompt_tokens: int, num_output_tokens: int, params: SamplingParams, max_model_len: int
) -> None:
    """Tokens generated elsewhere (a prefill worker's first, a migrated sequence's) leave
    something to generate, under both ``max_model_len`` and ``max_tokens``."""
    if not num_output_tokens:
        return
    if num_prompt_tokens + num_output_tokens >= max_model_len:
        raise InvalidRequestError(
            f"{num_prompt_tokens} prompt + {num_output_tokens} output tokens leave no room "
            f"below max_model_len={max_model_len}: nothing is left to generate",
            "output_token_ids",
        )
    if params.max_tokens is not None and num_output_tokens >= params.max_tokens:
        raise InvalidRequestError(
            f"{num_output_tokens} tokens were already generated; max_tokens is "
            f"{params.max_tokens}: nothing is left to generate",
            "output_token_ids",
        )


def check_remote_kv(
    remote_kv: RemoteKV,
    prompt: Sequence[int],
    num_output_tokens: int,
    params: SamplingParams,
    *,
    block_size: int,
    can_pull: bool,
) -> None:
    """A KV handle this engine can pull, covering exactly the prompt, with the token
    sampled after it; and no prompt logprobs, which need the prompt computed here."""
    if params.prompt_logprobs is not None:
        raise InvalidRequestError(
            "prompt_logprobs needs the prompt computed here, not pulled (the worker that "
            "prefilled it scores it)",
            "prompt_logprobs",
        )
    if not can_pull:
        raise InvalidRequestError("this engine cannot pull remote KV", "kv")
    if not num_output_tokens:
        raise InvalidRequestError(
            "a KV handle comes with the token sampled after the prompt (output_token_ids), "
            "which the KV does not cover",
            "output_token_ids",
        )
    num_blocks = cdiv(len(prompt), block_size)
    if remote_kv.num_tokens != len(prompt) or len(remote_kv.block_ids) != num_blocks:
        raise InvalidRequestError(
            f"the KV handle covers {remote_kv.num_tokens} tokens in "
            f"{len(remote_kv.block_ids)} blocks; the prompt has {len(prompt)}",
            "kv",
        )
