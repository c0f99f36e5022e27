"""Embeddings: a prompt's last hidden state, pooled instead of sampled from.

An embedding request is a prompt with nothing to generate. It is scheduled like any
prompt (chunked, prefix-cached, batched with generating requests), and the step that
computes its last token reads that token's hidden state (after the final norm) instead of
sampling. That is last-token pooling, what decoder embedding models use (Qwen3-Embedding,
gte-Qwen2, e5-mistral, SFR-Embedding) and vLLM's default for them.

Only the last token is pooled, so a prefix-cache hit never changes an embedding: the last
token is always computed (``KVCacheManager.get_computed_blocks``). Mean or first-token
pooling would need the hidden states of tokens a hit skips; they are not offered.
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
    similarity; what embedding models are trained for, and vLLM's default."""

    normalize: bool = True


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
