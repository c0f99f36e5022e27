"""Seeded sampling keyed by output position: the contract that lets a request continue on
another worker (disaggregated, or moved after a decode worker died) with no skip-ahead."""

from __future__ import annotations

import torch

from engine.sampler import RequestRandom, token_seed


def test_token_seeds_are_splitmix64_and_pinned():
    """Prefill and decode workers (maybe of different versions during a rollout) must agree
    on it: SplitMix64's published first output from state 0, and a value of ours."""
    assert token_seed(0, 0) == 0xE220A8397B1DCDAF
    assert token_seed(7, 1) == 309689372594955804
    assert len({token_seed(seed, i) for seed in range(50) for i in range(50)}) == 2500


def test_a_draw_depends_only_on_seed_position_and_distribution():
    probs = torch.softmax(torch.randn(5000), -1)
    here = RequestRandom(11, torch.Generator())
    for index in range(7):  # whatever was drawn before on this worker
        torch.multinomial(probs, 1, generator=here.for_token(index))
    elsewhere = RequestRandom(11, torch.Generator())  # another worker, resuming at 7
    draws = [int(torch.multinomial(probs, 1, generator=r.for_token(7))) for r in (here, elsewhere)]
    assert draws[0] == draws[1]
