"""Embeddings: a prompt's last hidden state, pooled instead of sampled from.

An embedding request is a prompt with nothing to generate. It is scheduled like any
prompt (chunked, prefix-cached, batched with generating requests), and the step that
computes its last token reads that token's hidden state (after the final norm) instead of
sampling. That is last-token pooling, what decoder embedding models use (Qwen3-Embedding,
gte-Qwen2, e5-mistral, SFR-Embedding) and vLLM's default for them.

Only the last token is pooled, so a prefix-cache hit never changes an embedding: the last
token is always computed (``KVCacheManager.get_computed_blocks``). Mean or first-token
pooling would need the hidden states of tokens a hit skips; they are not offered.

With ``token_ids`` the vector is instead the last token's logits at those ids: a causal
LM used as a classifier or reranker (Qwen3-Reranker reads "no" and "yes" after its
prompt; bge-reranker-v2-gemma "Yes"). The logits come from the same pass as a sampled
token's (soft-capping and all), so they equal the model's next-token logits there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """How an embedding request turns its last hidden state into a vector.

    ``normalize``: scale it to unit length (L2), so a dot product is the cosine
    similarity; what embedding models are trained for, and vLLM's default.
    ``token_ids``: when given, the vector is the last token's raw logits at these ids, in
    this order (``normalize`` does not apply); the model needs its language-model head."""

    normalize: bool = True
    token_ids: tuple[int, ...] = ()


# What an embedding request samples: nothing. The engine's request carries sampling
# params whatever it does; these ask for no randomness and no per-token state.
EMBEDDING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


def pool_last_tokens(
    hidden: torch.Tensor,  # [num_tokens, hidden_size] (after the final norm)
    rows: list[int],  # each embedding request's last row of the step
    normalize: list[bool],  # per row
) -> torch.Tensor:  # [num_rows, hidden_size] float32, on the CPU
    """One vector per row, in row order. A tensor, not lists: at 64 rows of 4096 a
    ``tolist`` took the engine thread ~8 ms a step; the worker sends the bytes as they
    are."""
    vectors = hidden[rows].float()
    if any(normalize):
        mask = torch.tensor(normalize, device=vectors.device).unsqueeze(1)
        vectors = torch.where(mask, F.normalize(vectors, dim=-1), vectors)
    return vectors.cpu()


def pick_token_logits(
    logits: torch.Tensor,  # [num_rows, vocab] (a logits pass over the pooled rows)
    token_ids: list[tuple[int, ...]],  # per row
) -> list[torch.Tensor]:  # per row: [len(token_ids[row])] float32, on the CPU
    """Each row's logits at its own token ids: one gather and one copy to the host for
    the step, not one per row."""
    rows = [row for row, ids in enumerate(token_ids) for _ in ids]
    columns = [token for ids in token_ids for token in ids]
    picked = logits[rows, columns].float().cpu()  # [sum of len(token_ids[row])]
    return list(picked.split([len(ids) for ids in token_ids]))
