"""The sizing over random profiles and demands: it always answers, the layout it gives
meets the targets it can meet (``predict`` finds no miss there but a target noted out of
reach), one fewer worker of a role misses, and more traffic never needs fewer workers
(until a target drops out of reach: then the rest are sized without it); targets means
or percentiles."""

from __future__ import annotations

import random

import pytest

from planner.demand import Demand, RequestShape
from planner.profile_data import DecodePoint, EngineFacts, PrefillPoint, Profile, RoleProfile
from planner.sizing import Targets, predict, size


def random_profile(rng: random.Random) -> Profile:
    """Costs that rise with size, as measured ones do (plus a knee for some)."""
    facts = EngineFacts(16, rng.choice([8, 64, 256]), 2048, rng.choice([20_000, 2_000_000]),
                        32768, 1, "float32", "cpu")  # fmt: skip
    token_s = rng.uniform(1e-5, 1e-3)
    prefill = [
        PrefillPoint(isl, overhead + isl * token_s * (1 + isl / 20_000),
                     1 / (token_s * (1 + isl / 20_000)))
        for overhead in [rng.uniform(0.001, 0.05)]
        for isl in (128, 1024, 8192)
    ]  # fmt: skip
    base, per_seq, per_kv = rng.uniform(0.002, 0.05), rng.uniform(1e-5, 1e-3), rng.uniform(0, 1e-7)
    knee = rng.choice([None, 16, 64])
    decode = [
        DecodePoint(b, c, base + b * per_seq + b * c * per_kv
                    + (0 if knee is None or b <= knee else (b - knee) * per_seq * 4))
        for b in (1, 4, 16, 64, 256)
        for c in (512, 8192)
    ]  # fmt: skip
    return Profile("m", "cpu", "now", RoleProfile(facts, prefill=prefill),
                   RoleProfile(facts, decode=decode))  # fmt: skip


def random_shapes(rng: random.Random) -> tuple[RequestShape, ...]:
    shapes = []
    for _ in range(rng.randint(1, 40)):
        isl = rng.randint(1, 6000)
        shapes.append(RequestShape(isl, rng.randint(1, isl), rng.randint(1, 800)))
    return tuple(shapes)


@pytest.mark.parametrize("seed", range(60))
def test_sizing_properties(seed):
    rng = random.Random(seed)
    profile = random_profile(rng)
    shapes = random_shapes(rng)
    targets = Targets(rng.uniform(0.05, 5.0), rng.uniform(0.005, 0.2),
                      rng.choice([0.7, 0.85, 1.0]), rng.choice([0, 256, 2048]),
                      rng.choice([None, 50, 90, 99]), rng.choice([None, 50, 90, 99]))  # fmt: skip
    previous = (0, 0)
    for rate in (0.1, 1.0, 5.0, 20.0):
        demand = Demand(rate, shapes)
        sizing = size(profile, demand, targets)
        layout = (sizing.prefill.replicas, sizing.decode.replicas)
        out_of_reach = {n.kind.removesuffix("_reach") for n in sizing.notes if "reach" in n.kind}
        # More traffic never needs fewer workers of either role.
        if not out_of_reach:
            assert layout[0] >= previous[0] and layout[1] >= previous[1], (rate, layout, previous)
        previous = layout
        # The layout meets every target it can (where one is unmeetable, a note says so).
        at = predict(profile, demand, targets, *layout)
        assert at.prefill.limit in ("", *out_of_reach), (rate, layout, at)
        assert at.decode.limit in ("", *out_of_reach), (rate, layout, at)
        # One fewer of a role misses something (without prefill workers the decode
        # workers prefill every prompt, which a layout sized with them need not miss).
        if layout[0] > 1:
            fewer = predict(profile, demand, targets, layout[0] - 1, layout[1])
            assert fewer.prefill.limit, (rate, layout, fewer.prefill)
        if layout[1] > 1:
            fewer = predict(profile, demand, targets, layout[0], layout[1] - 1)
            assert fewer.decode.limit, (rate, layout, fewer.decode)
