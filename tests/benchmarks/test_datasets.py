"""Dataset construction and arrival schedules (no server)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from benchmarks.loadgen.arrivals import LoadSpec, gamma_starts, session_starts, trace_starts
from benchmarks.loadgen.datasets import build_workload
from benchmarks.loadgen.spec import DatasetSpec
from benchmarks.loadgen.tokens import FIRST_ID, TokenSource
from benchmarks.loadgen.traces import default_trace, mooncake_prompt
from tests.support.processes import ROOT

TOKENS = TokenSource(vocab_size=500, seed=3)


def write_mooncake(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_same_block_id_same_tokens_other_ids_and_seeds_differ():
    assert TOKENS.block(7, 16) == TokenSource(500, 3).block(7, 16)
    assert TOKENS.block(7, 16) != TOKENS.block(8, 16)
    assert TOKENS.block(7, 16) != TokenSource(500, 4).block(7, 16)
    assert all(FIRST_ID <= t < 500 for t in TOKENS.block(7, 512))


def test_block_tokens_are_the_same_in_another_process():
    code = ("from benchmarks.loadgen.tokens import TokenSource;"
            "print(list(TokenSource(500, 3).block(123456789, 32)))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True, env={"PYTHONHASHSEED": "77"})  # fmt: skip
    assert json.loads(out.stdout) == list(TOKENS.block(123456789, 32))


def test_mooncake_rows_share_exactly_their_common_leading_blocks(tmp_path):
    rows = [
        {"timestamp": 1000, "input_length": 1500, "output_length": 40, "hash_ids": [0, 1, 2]},
        {"timestamp": 1250, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 9]},
        {"timestamp": 3000, "input_length": 10, "output_length": 3, "hash_ids": [5]},
    ]
    trace = write_mooncake(tmp_path / "t.jsonl", rows)
    spec = DatasetSpec("mooncake", num_requests=10, trace=trace, block_tokens=16,
                       output_scale=0.5)  # fmt: skip
    workload = build_workload(spec, TOKENS)
    prompts = [s.turns[0].new_tokens for s in workload.sessions]
    # Lengths scale by 16/512: ceil(1500/32) = 47, ceil(1100/32) = 35, ceil(10/32) = 1.
    assert [len(p) for p in prompts] == [47, 35, 1]
    assert prompts[0][:32] == prompts[1][:32] == TOKENS.block(0, 16) + TOKENS.block(1, 16)
    assert prompts[0][32:] == TOKENS.block(2, 16)[:15]
    assert prompts[1][32:] == TOKENS.block(9, 16)[:3]
    assert prompts[2] == TOKENS.block(5, 16)[:1]
    assert [s.turns[0].output_tokens for s in workload.sessions] == [20, 4, 2]
    assert [s.arrival_s for s in workload.sessions] == [0.0, 0.25, 2.0]
    # Rebuilding gives the same workload; offset and count select rows.
    assert build_workload(spec, TOKENS) == workload
    later = build_workload(DatasetSpec("mooncake", num_requests=1, trace=trace, trace_offset=1,
                                       block_tokens=16), TOKENS)  # fmt: skip
    assert later.sessions[0].turns[0].new_tokens == prompts[1]


def test_mooncake_prompt_refuses_rows_its_blocks_cannot_cover():
    with pytest.raises(ValueError):
        mooncake_prompt([1], 600, TOKENS, 512)


@pytest.mark.skipif(not default_trace("mooncake").exists(), reason="shared traces absent")
def test_real_mooncake_trace_scales_and_shares_prefixes():
    spec = DatasetSpec("mooncake", num_requests=50, block_tokens=16)
    workload = build_workload(spec, TOKENS)
    rows = [json.loads(line) for line in default_trace("mooncake").open().readlines()[:50]]
    for row, session in zip(rows, workload.sessions, strict=True):
        prompt = session.turns[0].new_tokens
        assert len(prompt) == math.ceil(row["input_length"] / 32)
        assert prompt[:16] == TOKENS.block(row["hash_ids"][0], 16)


def test_azure_lengths_and_times_come_from_the_csv(tmp_path):
    trace = tmp_path / "azure.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:46.6805900,374,44\n"
                     "2023-11-16 18:15:47.1805900,100,1\n"
                     "2023-11-16 18:15:50.6805900,9,300\n")  # fmt: skip
    spec = DatasetSpec("azure", num_requests=3, trace=trace, input_scale=0.5, output_scale=0.1)
    sessions = build_workload(spec, TOKENS).sessions
    assert [len(s.turns[0].new_tokens) for s in sessions] == [187, 50, 4]  # round, >= 1
    assert [s.turns[0].output_tokens for s in sessions] == [4, 1, 30]
    assert [s.arrival_s for s in sessions] == pytest.approx([0.0, 0.5, 4.0])


def test_random_prompts_share_nothing_and_lengths_stay_in_range():
    spec = DatasetSpec("random", num_requests=50, input_len=100, output_len=10, range_ratio=0.2)
    sessions = build_workload(spec, TOKENS).sessions
    prompts = [s.turns[0].new_tokens for s in sessions]
    assert all(80 <= len(p) <= 120 for p in prompts)
    assert all(8 <= s.turns[0].output_tokens <= 12 for s in sessions)
    assert len({p[:16] for p in prompts}) == 50
    other_run = build_workload(spec, TokenSource(500, 4)).sessions
    assert other_run[0].turns[0].new_tokens != prompts[0]


def test_the_runs_of_a_sweep_send_the_same_shapes_with_other_tokens():
    """Run i of a sweep draws its tokens from seed + i; its lengths and each prompt's
    prefix came from there too, so each point of a latency-vs-rate curve had a workload
    of its own (±6% of prompt tokens in a stored record; an audit)."""
    spec = DatasetSpec("prefix-repetition", num_requests=30, prefix_len=16, num_prefixes=4,
                       input_len=40, output_len=10, range_ratio=0.5)  # fmt: skip
    runs = [build_workload(spec, TokenSource(500, 3 + i, shape_seed=3)).sessions for i in range(3)]
    shapes = [[(len(s.turns[0].new_tokens), s.turns[0].output_tokens) for s in run] for run in runs]
    assert shapes[0] == shapes[1] == shapes[2] and len(set(shapes[0])) > 5
    groups = []
    for run in runs:
        firsts: dict[tuple, int] = {}
        groups.append([firsts.setdefault(s.turns[0].new_tokens[:16], len(firsts)) for s in run])
    assert groups[0] == groups[1] == groups[2]  # the same requests share a prefix
    assert runs[0][0].turns[0].new_tokens != runs[1][0].turns[0].new_tokens


def test_prefix_repetition_uses_few_prefixes_and_fresh_suffixes():
    spec = DatasetSpec("prefix-repetition", num_requests=40, prefix_len=64, num_prefixes=3,
                       input_len=8, output_len=4)  # fmt: skip
    prompts = [s.turns[0].new_tokens for s in build_workload(spec, TOKENS).sessions]
    assert all(len(p) == 72 for p in prompts)
    assert len({p[:64] for p in prompts}) == 3
    assert len({p[64:] for p in prompts}) == 40


def test_multi_turn_sessions_cover_the_request_count():
    spec = DatasetSpec("multi-turn", num_requests=10, turns=4, input_len=8, output_len=4,
                       think_time_s=0.5)  # fmt: skip
    workload = build_workload(spec, TOKENS)
    assert [len(s.turns) for s in workload.sessions] == [4, 4, 2]
    assert workload.num_requests == 10 and workload.sessions[0].think_time_s == 0.5


def test_fitting_to_the_context_window_and_caps():
    spec = DatasetSpec("random", num_requests=4, input_len=300, output_len=50,
                       max_output_tokens=40)  # fmt: skip
    workload = build_workload(spec, TOKENS, max_model_len=200)
    for session in workload.sessions:
        turn = session.turns[0]
        assert turn.output_tokens == 40 and len(turn.new_tokens) == 160
    assert workload.notes and "4 of 4 sessions" in workload.notes[0]
    unclipped = build_workload(spec, TOKENS)
    clipped = workload.sessions[0].turns[0].new_tokens
    assert clipped == unclipped.sessions[0].turns[0].new_tokens[:160]
    chat = DatasetSpec("multi-turn", num_requests=4, turns=4, input_len=40, output_len=10)
    assert [len(s.turns) for s in build_workload(chat, TOKENS, 120).sessions] == [2]


def test_gamma_arrivals_have_the_rate_and_burstiness_asked_for():
    for burstiness in (1.0, 0.25):
        starts = np.asarray(gamma_starts(20001, rate=5.0, burstiness=burstiness, seed=1))
        gaps = np.diff(starts)
        assert starts[0] == 0.0 and gaps.mean() == pytest.approx(0.2, rel=0.05)
        # Gamma(k): coefficient of variation 1/sqrt(k) (Poisson: 1).
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)
    assert gamma_starts(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    assert gamma_starts(5, 2.0, 1.0, 7) == gamma_starts(5, 2.0, 1.0, 7)


def test_trace_arrivals_kept_scaled_or_fitted_to_a_rate():
    times = [10.0, 10.5, 12.0, 14.0]
    assert trace_starts(times) == [0.0, 0.5, 2.0, 4.0]
    assert trace_starts(times, time_scale=0.5) == [0.0, 0.25, 1.0, 2.0]
    fitted = trace_starts(times, rate=3.0)  # 3 gaps over 1 s
    assert fitted == pytest.approx([0.0, 0.125, 0.5, 1.0])
    assert trace_starts([5.0, 5.0], rate=2.0) == [0.0, 0.0]
    with pytest.raises(ValueError):
        session_starts(LoadSpec(replay=True), 2, None, 0)


@pytest.mark.parametrize("bad", [dict(rate=0), dict(burstiness=0), dict(concurrency=0),
                                 dict(time_scale=-1), dict(duration_s=0)])  # fmt: skip
def test_bad_loads_are_refused(bad):
    with pytest.raises(ValueError):
        LoadSpec(**bad)
