"""The tensor operations of sampling, each over a whole batch of logits rows at once.

Every function here takes ``[rows, vocab]`` tensors and per-row parameters, and issues a
fixed number of kernels whatever the batch: on a GPU a per-row loop costs a few launches
and a host sync per row, every step.

The random draw is inverse-CDF sampling at one uniform per row, and the uniform is a pure
function of the request's seed and the output position (``uniform``), so a token depends
only on the seed, its position and its distribution: a request continued on another
worker (the first token sampled by a prefill worker, a sequence moved after a decode
worker died) draws there exactly what it would have drawn in one place, with no
generator state to carry or skip ahead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_MASK64 = (1 << 64) - 1
_TWO_POW_53 = float(1 << 53)
# top-k / top-p look at the likeliest TOP_PREFIX tokens of a row first (a partial sort);
# only a row whose nucleus reaches past them is sorted whole (exact either way).
TOP_PREFIX = 1024


def token_seed(seed: int, index: int) -> int:
    """The 64-bit draw for output token ``index`` of a request seeded ``seed``: SplitMix64
    of the pair, so neighbouring positions and seeds get unrelated values. Pure integer
    arithmetic, the same on every host (a wire-level contract between workers: a prefill
    and a decode worker must agree on it)."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform(seed: int, index: int) -> float:
    """Output token ``index``'s uniform in [0, 1): the top 53 bits of ``token_seed``,
    exact in a float64."""
    return (token_seed(seed, index) >> 11) / _TWO_POW_53


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token of each row at its uniform: the first index whose cumulative probability
    exceeds ``u * total``, so a token of zero probability is never drawn and the rows
    need not be normalised. probs: [rows, V] (>= 0, each row some mass); uniforms: [rows]
    float64 in [0, 1). Returns [rows] int64. The sums run in float64."""
    cdf = probs.double().cumsum(-1)  # [rows, V]
    total = cdf[:, -1:]  # [rows, 1]
    # u < 1, but u * total may round up to total: stay strictly below it.
    target = torch.minimum(uniforms.to(cdf.device)[:, None] * total,
                           torch.nextafter(total, torch.zeros_like(total)))  # fmt: skip
    return torch.searchsorted(cdf, target, right=True)[:, 0]


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens less likely than ``min_p`` x the row's likeliest. logits: [rows, V],
    temperature-scaled; min_p: [rows] (0 masks nothing)."""
    probs = logits.softmax(-1)
    floor = min_p[:, None] * probs.amax(-1, keepdim=True)
    return logits.masked_fill(probs < floor, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]
) -> torch.Tensor:
    """Mask (to -inf) each row's tokens outside its top-k, then outside the top-p nucleus
    of what is left, as a sort of the row would: a token ranked below the k-th value goes
    (ties with it stay), and a token goes when the mass ranked above it already reaches
    top_p (the likeliest always stays). logits: [rows, V]; top_k: 0 or >= V is off;
    top_p: 1.0 is off.

    Sorts only the likeliest ``max(TOP_PREFIX, top_k)`` of each row (when that is under a
    quarter of the vocabulary; else every row whole). That is exact for a
    row when its nucleus ends inside that prefix (every later token has at least the
    prefix's mass above it), which holds for peaked distributions; the other rows, and a
    row whose k-th value has ties reaching past the prefix, are sorted whole."""
    vocab = logits.shape[-1]
    device = logits.device
    k = [value if 0 < value < vocab else vocab for value in top_k]
    prefix = min(vocab, max([TOP_PREFIX, *(value for value in k if value < vocab)]))
    k_t = torch.tensor(k, device=device)
    p_t = torch.tensor(top_p, dtype=torch.float64, device=device)
    if prefix * 4 > vocab:  # a small vocabulary: a partial sort would save little
        return _sorted_whole(logits, k_t, p_t)
    values, order = logits.topk(prefix, dim=-1)  # [rows, prefix], sorted descending
    kth = values.gather(1, (k_t.clamp(max=prefix) - 1)[:, None])  # [rows, 1]
    kth = torch.where(k_t[:, None] < vocab, kth, torch.full_like(kth, float("-inf")))
    masked = logits.masked_fill(logits < kth, float("-inf"))
    lse = torch.logsumexp(masked.double(), -1, keepdim=True)  # the top-k distribution's
    probs = (values.double() - lse).exp().masked_fill(values < kth, 0.0)  # [rows, prefix]
    above = probs.cumsum(-1) - probs  # mass ranked above each token
    drop = above >= p_t[:, None]
    drop[:, 0] = False
    nucleus = p_t < 1.0
    # Exact in the prefix unless the rest of the row may hold part of the nucleus, or
    # ties with the k-th value reach past the prefix (top-k keeps them all).
    whole = nucleus & (probs.sum(-1) < p_t)
    whole |= (k_t < vocab) & ((logits >= kth).sum(-1) > prefix)
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, order, ~drop)
    masked = torch.where(nucleus[:, None] & ~keep, float("-inf"), masked)
    if bool(whole.any()):
        again = whole.nonzero()[:, 0]
        masked[again] = _sorted_whole(logits[again], k_t[again], p_t[again])
    return masked


def _sorted_whole(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``apply_top_k_top_p`` for rows sorted whole. logits: [rows, V]; k: [rows] (V: off);
    p: [rows] float64 (1.0: off)."""
    vocab = logits.shape[-1]
    values, order = logits.sort(-1, descending=True)
    kth = values.gather(1, (k - 1)[:, None])
    kth = torch.where(k[:, None] < vocab, kth, torch.full_like(kth, float("-inf")))
    values = values.masked_fill(values < kth, float("-inf"))
    probs = values.double().softmax(-1)
    drop = (probs.cumsum(-1) - probs) >= p[:, None]
    drop[:, 0] = False
    values = values.masked_fill(drop & (p[:, None] < 1.0), float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, values)
