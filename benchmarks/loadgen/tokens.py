"""Synthetic prompt token ids.

Ids are drawn uniformly from ``[FIRST_ID, vocab_size)``: the low ids, where tokenizers put
their special tokens, are skipped. Content does not matter to a serving benchmark (outputs
are forced to their length with ``ignore_eos``); what matters is that equal blocks are
equal (prefix-cache hits) and that everything else differs (no accidental hits).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from benchmarks.loadgen.spec import DEFAULT_VOCAB_SIZE

FIRST_ID = 16

# Separates the key spaces of trace blocks and fresh tokens, so a block id never collides
# with a stream's draw; and of shapes (lengths, choices), which do not follow ``seed``.
_BLOCK_DOMAIN = 0x6B6C
_SHAPE_DOMAIN = 0x5348


@dataclass(frozen=True, slots=True)
class TokenSource:
    """Deterministic token ids. ``seed`` names the universe: the same seed gives the same
    blocks and streams in every process; another seed gives unrelated ones (a sweep uses
    one seed per run so that one run never hits the cache of another). ``shape_seed``
    (default: ``seed``) names the shapes a dataset draws from ``shape_stream``: its
    lengths and which prefix each prompt takes, the same in every run of a sweep."""

    vocab_size: int = DEFAULT_VOCAB_SIZE
    seed: int = 0
    shape_seed: int | None = None

    def __post_init__(self) -> None:
        if self.vocab_size <= FIRST_ID:
            raise ValueError(f"vocab_size must be > {FIRST_ID}, got {self.vocab_size}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")

    def block(self, block_id: int, num_tokens: int) -> tuple[int, ...]:
        """The tokens of trace block ``block_id``: a pure function of (seed, block_id,
        num_tokens). Blocks of the same length and different ids are independent draws."""
        if block_id < 0:
            raise ValueError(f"block ids must be >= 0, got {block_id}")
        rng = np.random.default_rng([self.seed, _BLOCK_DOMAIN, block_id])
        return self.draw(rng, num_tokens)

    def stream(self, stream_id: int) -> np.random.Generator:
        """A generator for fresh tokens of one dataset (use :meth:`draw` on it)."""
        return np.random.default_rng([self.seed, stream_id])

    def shape_stream(self, stream_id: int) -> np.random.Generator:
        """A generator for one dataset's shapes (lengths, choices), not its tokens."""
        shape_seed = self.seed if self.shape_seed is None else self.shape_seed
        return np.random.default_rng([shape_seed, _SHAPE_DOMAIN, stream_id])

    def draw(self, rng: np.random.Generator, num_tokens: int) -> tuple[int, ...]:
        """``num_tokens`` fresh ids from ``rng``."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return tuple(rng.integers(FIRST_ID, self.vocab_size, size=num_tokens).tolist())
