"""The tensor operations of sampling, each over a whole batch of logits rows at once.

Every function here takes ``[rows, vocab]`` tensors and per-row parameters, and issues a
fixed number of kernels whatever the batch (the draw's noise excepted: a launch per row,
from each request's own generator) and no host sync per row: on a GPU the per-row loop it
replaced cost a few launches and a sync per row, every step.

The draw is ``torch.multinomial``'s for one sample, the exponential race: the token is
``argmax(p / q)`` with ``q ~ Exp(1)`` per vocabulary entry, from the request's generator
seeded anew for each output position (``RequestRandom``). So a token depends only on the
seed, its position and its distribution: a request continued on another worker (the
first token sampled by a prefill worker, a sequence moved after a decode worker died)
draws there exactly what it would have drawn in one place, with no skip-ahead, and the
tokens are the ones the per-row ``torch.multinomial`` drew. The race also shrugs off a
rescaling of the probabilities (a softmax normaliser rounded differently after a
recompute), which moves every boundary of an inverse CDF: tried first, that flipped a
seeded token in most migrated runs of the tiny model (tests/router/test_migration.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1
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


@dataclass(slots=True)
class RequestRandom:
    """A non-greedy request's random stream (the module docstring)."""

    seed: int
    generator: torch.Generator  # on the logits' device

    def for_token(self, index: int) -> torch.Generator:
        """The generator, seeded for the request's output token ``index``."""
        self.generator.manual_seed(token_seed(self.seed, index))
        return self.generator


def exponential_race(
    probs: torch.Tensor, draws: Sequence[tuple[RequestRandom, int]]
) -> torch.Tensor:
    """Each row's token: ``argmax(p / q)``, ``q ~ Exp(1)`` from the row's generator seeded
    for its output position (``draws``: (stream, index) per row), exactly as
    ``torch.multinomial(p, 1, generator=...)`` draws it. The noise needs a launch per row
    (a generator each; a request's speculative positions share one, seeded in turn); the
    division and the argmax are one each, and nothing waits for the device. probs:
    [rows, V] (rows need not be normalised). Returns [rows] int64."""
    noise = torch.empty_like(probs)
    for row, (random, index) in enumerate(draws):
        noise[row].exponential_(1, generator=random.for_token(index))
    return (probs / noise).argmax(-1)


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
    quarter of the vocabulary; else every row whole). That is exact for a row when its
    nucleus ends inside that prefix (every later token has at least the prefix's mass
    above it), which holds for peaked distributions; the other rows, and a row whose k-th
    value has ties reaching past the prefix, are sorted whole."""
    vocab = logits.shape[-1]
    device = logits.device
    k = [value if 0 < value < vocab else vocab for value in top_k]
    prefix = min(vocab, max([TOP_PREFIX, *(value for value in k if value < vocab)]))
    if prefix * 4 > vocab:  # a small vocabulary: a partial sort would save little
        prefix = vocab
    k_t = torch.tensor(k, device=device)
    p_t = torch.tensor(top_p, dtype=torch.float64, device=device)
    return _cut(logits, k_t, p_t, prefix)


def _cut(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor, prefix: int) -> torch.Tensor:
    """``apply_top_k_top_p`` from each row's likeliest ``prefix`` tokens, again from the
    whole row for the rows where that prefix cannot decide. logits: [rows, V]; k: [rows]
    (V: off); p: [rows] float64 (1.0: off)."""
    vocab = logits.shape[-1]
    # [rows, prefix], descending; a whole row is sorted, which orders ties as the
    # per-row reference's sort does (top-p then drops the same tied tokens).
    values, order = (
        logits.sort(-1, descending=True) if prefix == vocab else logits.topk(prefix, dim=-1)
    )
    kth = values.gather(1, (k.clamp(max=prefix) - 1)[:, None])  # [rows, 1]
    kth = torch.where(k[:, None] < vocab, kth, torch.full_like(kth, float("-inf")))
    masked = logits.masked_fill(logits < kth, float("-inf"))
    lse = torch.logsumexp(masked.double(), -1, keepdim=True)  # the top-k distribution's
    probs = (values.double() - lse).exp().masked_fill(values < kth, 0.0)  # [rows, prefix]
    above = probs.cumsum(-1) - probs  # mass ranked above each token
    drop = above >= p[:, None]
    drop[:, 0] = False
    nucleus = p < 1.0
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, order, ~drop)
    masked = torch.where(nucleus[:, None] & ~keep, float("-inf"), masked)
    if prefix == vocab:
        return masked
    # Exact in the prefix unless the rest of the row may hold part of the nucleus, or
    # ties with the k-th value reach past the prefix (top-k keeps them all).
    whole = nucleus & (probs.sum(-1) < p)
    whole |= (k < vocab) & ((logits >= kth).sum(-1) > prefix)
    if bool(whole.any()):
        again = whole.nonzero()[:, 0]
        masked[again] = _cut(logits[again], k[again], p[again], vocab)
    return masked
