"""A profile file as ``pdserve plan size`` and the router's live plan read it: what a
hand edit breaks is refused naming the file and the field, not met deep in the sizing
(a ``kv_capacity_tokens`` of 0 was a ZeroDivisionError there, at a router's start)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.profile_data import ProfileError, read_profile, write_profile
from tests.support.profiles import make_profile


def edited(tmp_path: Path, edit) -> Path:
    path = tmp_path / "profile.json"
    write_profile(make_profile(), path)
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))
    return path


def test_a_written_profile_reads_back(tmp_path):
    assert read_profile(edited(tmp_path, lambda raw: None)) == make_profile()


@pytest.mark.parametrize("key", ["kv_capacity_tokens", "max_num_seqs", "block_size"])
def test_engine_facts_the_sizing_divides_by_must_be_positive(tmp_path, key):
    path = edited(tmp_path, lambda raw: raw["decode"]["engine"].update({key: 0}))
    with pytest.raises(ProfileError, match=rf"{path} is not a pdserve profile.*>= 1.*"
                                           rf"\$\.decode\.engine\.{key}"):  # fmt: skip
        read_profile(path)


def test_repeated_points_name_the_file(tmp_path):
    path = edited(tmp_path, lambda raw: raw["prefill"]["prefill"].append(
        raw["prefill"]["prefill"][0]))  # fmt: skip
    with pytest.raises(ProfileError, match=rf"{path}: prefill points repeat a prompt length"):
        read_profile(path)
    path = edited(tmp_path, lambda raw: raw["decode"]["decode"].append(raw["decode"]["decode"][1]))
    with pytest.raises(ProfileError, match=rf"{path}: decode points repeat a \(context, batch\)"):
        read_profile(path)
