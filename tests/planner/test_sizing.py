"""The sizing against cases worked by hand: an M/G/1 prefill queue per worker, decode
batches at Little's law, and the limits that bind."""

from __future__ import annotations

import pytest

from planner.demand import Demand, RequestShape
from planner.profile_data import DecodePoint, Profile, RoleProfile
from planner.sizing import Targets, describe, predict, size
from tests.support.profiles import make_profile


def test_prefill_workers_follow_the_mg1_wait():
    """1.5 prompts/s of 1000 tokens, 1 s each: two workers are 75% busy and a prompt
    waits 0.75 * 1 / (2 * 0.25) = 1.5 s, so TTFT 2.5 s; with three, 50% busy, 0.5 s."""
    demand = Demand(1.5, (RequestShape(1000, 1000, 1),))
    loose = size(make_profile(), demand, Targets(ttft_s=3.0, itl_s=1.0))
    assert loose.prefill.replicas == 2
    assert loose.prefill.utilization == pytest.approx(0.75)
    assert loose.prefill.ttft_s == pytest.approx(2.5)
    assert loose.prefill.limit == "prompt throughput"  # one worker would be 150% busy
    tight = size(make_profile(), demand, Targets(ttft_s=2.0, itl_s=1.0))
    assert tight.prefill.replicas == 3
    assert tight.prefill.ttft_s == pytest.approx(1.5)
    assert tight.prefill.limit == "ttft"
    capped = size(make_profile(), demand, Targets(ttft_s=3.0, itl_s=1.0, max_utilization=0.7))
    assert (capped.prefill.replicas, capped.prefill.limit) == (3, "utilization")
    assert not loose.notes


def test_cached_prefixes_cut_prefill_work():
    """A 1000-token prompt with 900 cached costs 100 tokens' work (0.1 s)."""
    demand = Demand(5.0, (RequestShape(1000, 100, 1),))
    sizing = size(make_profile(), demand, Targets(ttft_s=3.0, itl_s=1.0, min_disagg_tokens=0))
    assert sizing.prefill.replicas == 1
    assert sizing.prefill.utilization == pytest.approx(0.5)


def test_decode_batch_follows_the_product_form_law():
    """5 requests/s of 100 decode tokens: 500 tokens/s. Steps of 10 + k ms make the
    batch's law a negative binomial, ``P(N) ~ prod (500 (0.01 + 0.001 j) / j)``: mean
    ITL ``itl(1) / (1 - 0.001 * 500)`` = 22 ms, ``N`` 500 * 0.022 = 11 on average. A
    15 ms target needs two workers: 250 tokens/s each, 11 / 0.75 = 14.7 ms, 3.67 in
    flight."""
    demand = Demand(5.0, (RequestShape(1000, 1000, 101),))
    one = size(make_profile(), demand, Targets(ttft_s=10.0, itl_s=0.025))
    assert one.decode.replicas == 1
    assert one.decode.batch == pytest.approx(11, rel=1e-6)
    assert one.decode.itl_s == pytest.approx(0.022, rel=1e-6)
    assert one.decode.context_tokens == pytest.approx(1050)
    two = size(make_profile(), demand, Targets(ttft_s=10.0, itl_s=0.015))
    assert two.decode.replicas == 2
    assert two.decode.itl_s == pytest.approx(0.011 / 0.75, rel=1e-6)
    assert two.decode.batch == pytest.approx(250 * 0.011 / 0.75, rel=1e-6)
    assert two.decode.limit == "itl"


def test_kv_and_max_num_seqs_bound_the_batch():
    """11 requests in flight on average (above), each holding 1050 + 16 tokens: a
    20,000-token pool at 85% fits 15.9, a 10,000-token one 7.97 (two workers, 3.67
    each). With max_num_seqs 8, eight running make 8 / 0.018 = 444 tokens/s, fewer than
    the 500 asked: the waiting line never drains on one worker."""
    demand = Demand(5.0, (RequestShape(1000, 1000, 101),))
    targets = Targets(ttft_s=10.0, itl_s=0.1)
    assert size(make_profile(kv_capacity_tokens=20_000), demand, targets).decode.replicas == 1
    small_kv = size(make_profile(kv_capacity_tokens=10_000), demand, targets).decode
    assert (small_kv.replicas, small_kv.limit) == (2, "kv")
    assert small_kv.kv_fraction == pytest.approx(small_kv.batch * 1066 / 10_000)
    few_seqs = size(make_profile(max_num_seqs=8), demand, targets).decode
    assert (few_seqs.replicas, few_seqs.limit) == (2, "max_num_seqs")
    one = predict(make_profile(max_num_seqs=8), demand, targets, 1, 1).decode
    assert one.batch == float("inf") and one.limit == "max_num_seqs"


def test_short_prompts_are_prefilled_on_decode_workers_and_stretch_their_steps():
    """Prompts under min_disagg_tokens (200 tokens: 0.2 s each, 2/s) busy the decode
    workers 40%: no prefill worker, and a 20 ms step is seen as 20 / 0.6 ms."""
    demand = Demand(2.0, (RequestShape(200, 200, 1),))
    sizing = size(make_profile(), demand, Targets(ttft_s=1.0, itl_s=0.05, min_disagg_tokens=256))
    assert sizing.prefill.replicas == 0
    assert sizing.decode.local_prefill_fraction == pytest.approx(0.4)
    decoding = Demand(2.0, (RequestShape(200, 200, 101),))
    sizing = size(make_profile(), decoding, Targets(ttft_s=1.0, itl_s=0.05, min_disagg_tokens=256))
    # 200 tokens/s over 60% of the time, 333.3 while decoding: 11 / (1 - 0.333) = 16.5 ms
    assert sizing.decode.batch == pytest.approx(333.33 * 0.0165, rel=1e-4)
    assert sizing.decode.itl_s == pytest.approx(0.0165 / 0.6, rel=1e-4)


def test_targets_no_layout_meets_are_warned_and_the_rest_still_sized():
    demand = Demand(3.0, (RequestShape(10_000, 10_000, 2),))
    sizing = size(make_profile(), demand, Targets(ttft_s=5.0, itl_s=0.005))
    assert sizing.prefill.replicas == 36  # 30 busy workers at <= 85%
    warnings = describe(sizing.notes)
    assert any("TTFT target 5000 ms (mean) cannot be met: an idle prefill worker's mean for "
               "these prompts is 10000 ms" in w for w in warnings)  # fmt: skip
    assert any("ITL target 5.0 ms cannot be met: one request alone decodes at 11.0 ms" in w
               for w in warnings)  # fmt: skip


def test_lookups_beyond_the_profile_are_warned():
    demand = Demand(1.0, (RequestShape(20_000, 20_000, 11),))
    sizing = size(make_profile(), demand, Targets(ttft_s=100.0, itl_s=1.0))
    warnings = describe(sizing.notes)
    assert any("prompts of 20000 tokens (profiled up to 10000)" in w for w in warnings)
    assert any("decode context of 20005 tokens" in w for w in warnings)
    # Over windows: one line per kind, the worst of them.
    other = size(make_profile(), Demand(1.0, (RequestShape(15_000, 15_000, 11),)),
                 Targets(ttft_s=100.0, itl_s=1.0))  # fmt: skip
    merged = describe([*other.notes, *sizing.notes])
    assert len(merged) == 2 and "prompts of 20000 tokens" in merged[0]


def test_no_load_needs_one_decode_worker_only():
    sizing = size(make_profile(), Demand(0.0, (RequestShape(500, 500, 10),)),
                  Targets(ttft_s=1.0, itl_s=0.1))  # fmt: skip
    assert (sizing.prefill.replicas, sizing.decode.replicas) == (0, 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ttft_s": 0.0, "itl_s": 1.0}, "ttft_s target must be"),
        ({"ttft_s": 1.0, "itl_s": float("nan")}, "itl_s target must be"),
        ({"ttft_s": 1.0, "itl_s": 1.0, "max_utilization": 1.5}, "max_utilization"),
    ],
)
def test_bad_targets_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Targets(**kwargs)


def test_predict_a_given_layout_names_the_target_it_misses():
    demand = Demand(1.5, (RequestShape(1000, 1000, 101),))
    targets = Targets(ttft_s=2.0, itl_s=0.015)
    short = predict(make_profile(), demand, targets, prefill_replicas=1, decode_replicas=1)
    assert short.prefill.limit == "prompt throughput" and short.prefill.ttft_s == float("inf")
    # 150 tokens/s on one decode worker: 11 / (1 - 0.15) = 12.9 ms, 1.94 in flight
    assert short.decode.itl_s == pytest.approx(0.011 / 0.85, rel=1e-6)
    assert short.decode.batch == pytest.approx(150 * 0.011 / 0.85, rel=1e-6)
    assert short.decode.limit == ""
    two = predict(make_profile(), demand, targets, prefill_replicas=2, decode_replicas=1)
    assert (two.prefill.ttft_s, two.prefill.limit) == (pytest.approx(2.5), "ttft")
    with pytest.raises(ValueError, match="at least one decode worker"):
        predict(make_profile(), demand, targets, prefill_replicas=1, decode_replicas=0)
    # Without prefill workers the router prefills every prompt on the decode workers
    # (1.5 s of prompts a second: more than one can take); it was "prompt throughput"
    # missed on a prefill side with no workers, and a decode side with no prefills. Their
    # TTFT is each decode worker's queue of prompts: 75% busy, 1 + 1.5 s, over the 2 s
    # target (it was 0 ms and no miss).
    alone = predict(make_profile(), demand, targets, prefill_replicas=0, decode_replicas=2)
    assert alone.decode.local_prefill_fraction == 0.75
    assert (alone.prefill.ttft_s, alone.prefill.limit) == (pytest.approx(2.5), "ttft")
    # 0.3 s of prompts a second on one worker, 30 tokens/s: 11 / (1 - 0.3 - 0.03) ms
    light = Demand(0.3, (RequestShape(1000, 1000, 101),))
    alone = predict(make_profile(), light, targets, prefill_replicas=0, decode_replicas=1)
    assert alone.decode.local_prefill_fraction == pytest.approx(0.3)
    assert alone.decode.itl_s == pytest.approx(0.011 / (1 - 0.3 - 0.03), rel=1e-6)
    assert alone.prefill.ttft_s == pytest.approx(1 + 0.3 / (2 * 0.7))
    assert alone.prefill.limit == "" and not alone.notes
    # A 3 s prompt against a 100 ms target: missed, and no layout can meet it.
    slow = Demand(0.5, (RequestShape(3000, 3000, 101),))
    alone = predict(make_profile(), slow, Targets(ttft_s=0.1, itl_s=0.1), 0, 2)
    assert (alone.prefill.ttft_s, alone.prefill.limit) == (pytest.approx(7.5), "ttft")
    assert [n.kind for n in alone.notes] == ["ttft_floor"]


def test_decode_is_planned_below_the_knee_of_its_token_rate():
    """Steps of 16 requests take 26 ms, of 32 take 100 ms: a worker makes at most 615
    tokens/s (at 16). 5.4 requests/s of 100 tokens ask 540 of it, 88%: one worker could
    reach 540 on paper (at b = 13.9), but a burst past 17 in flight slows every step
    more than it adds tokens and never drains (the law rises again behind a shallow
    dip): "step time", so two workers (each at 44%)."""
    profile = make_profile()
    decode = [DecodePoint(b, c, itl) for b, itl in ((1, 0.011), (16, 0.026), (32, 0.1))
              for c in (100, 10_000)]  # fmt: skip
    profile = Profile("m", "cpu", "now", profile.prefill, RoleProfile(profile.decode.engine,
                                                                      decode=decode))  # fmt: skip
    demand = Demand(5.4, (RequestShape(1000, 1000, 101),))
    sizing = size(profile, demand, Targets(ttft_s=10.0, itl_s=0.05)).decode
    assert (sizing.replicas, sizing.limit) == (2, "step time")
    assert sizing.utilization == pytest.approx(270 / (16 / 0.026), rel=1e-3)
    assert sizing.batch < 16  # the rise past 32 is behind a dip below e^-10: left out
    one = predict(profile, demand, Targets(ttft_s=10.0, itl_s=0.05), 1, 1).decode
    assert one.limit == "step time" and one.batch == float("inf")
    capped = size(profile, demand, Targets(ttft_s=10.0, itl_s=0.05, max_utilization=0.4))
    assert (capped.decode.replicas, capped.decode.limit) == (3, "utilization")


def test_decode_peak_is_read_up_to_the_batches_measured_at_its_context():
    """The profiler leaves out batches whose KV does not fit at long contexts. A short
    context measured to 64 (865 tokens/s) was held to the long one's 16 (615 tokens/s):
    600 tokens/s at context 100 read 98% of one worker, and two were planned."""
    profile = make_profile()
    decode = [DecodePoint(b, 100, 0.010 + 0.001 * b) for b in (1, 16, 64)]
    decode += [DecodePoint(b, 10_000, 0.010 + 0.001 * b) for b in (1, 16)]
    profile = Profile("m", "cpu", "now", profile.prefill, RoleProfile(profile.decode.engine,
                                                                      decode=decode))  # fmt: skip
    demand = Demand(6.0, (RequestShape(50, 50, 101),))  # context 50 + 100 / 2
    sizing = size(profile, demand, Targets(ttft_s=10.0, itl_s=0.05, min_disagg_tokens=0))
    assert sizing.decode.replicas == 1
    assert sizing.decode.utilization == pytest.approx(600 / (64 / 0.074), rel=1e-6)
    assert not sizing.notes
