"""What a profile holds: one worker's measured prefill and decode speed, as a JSON file.

``pdserve plan profile`` writes it (``planner/profiler.py``, which runs the engine);
``pdserve plan size`` reads it (torch-free). msgspec decodes it against these types, so a
hand-edited or stale file fails with the field that is wrong, not deep in the sizing.

Units are in the names: ``*_s`` seconds, ``*_tokens`` tokens, ``tokens_per_s`` prompt
tokens computed per second.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec

PROFILE_VERSION = 1


# A count the sizing divides by or sizes against: a 0 in a hand-edited file was a
# ZeroDivisionError deep in the sizing (a router with ``planner.profile`` died at start).
Positive = Annotated[int, msgspec.Meta(ge=1)]


class EngineFacts(msgspec.Struct, frozen=True):
    """The engine a role's points were measured on: what bounds a worker besides time."""

    block_size: Positive
    max_num_seqs: Positive
    max_num_batched_tokens: Positive
    kv_capacity_tokens: Positive  # KV pool blocks x block size
    max_model_len: Positive
    tensor_parallel_size: Positive
    dtype: str
    device: str


class PrefillPoint(msgspec.Struct, frozen=True):
    """Prompts of ``isl`` tokens (none cached). ``latency_s``: one prompt alone, from its
    arrival to its first token (its chunks, if the step budget splits it). ``tokens_per_s``:
    prompt tokens computed per second with enough prompts waiting to fill every step."""

    isl: int
    latency_s: float
    tokens_per_s: float


class DecodePoint(msgspec.Struct, frozen=True):
    """``batch`` requests decoding together, their contexts ``context_tokens`` long on
    average: ``itl_s`` is one step's time (one token for each)."""

    batch: int
    context_tokens: int
    itl_s: float


class RoleProfile(msgspec.Struct, frozen=True):
    engine: EngineFacts
    prefill: list[PrefillPoint] = []
    decode: list[DecodePoint] = []


class Profile(msgspec.Struct, frozen=True):
    """Both roles of one deployment, measured on ``machine``. A decode worker prefills short
    prompts too (the router's ``min_disagg_tokens``): the sizing takes that speed from the
    prefill role's points."""

    model: str
    machine: str
    created: str
    prefill: RoleProfile
    decode: RoleProfile
    version: int = PROFILE_VERSION


class ProfileError(ValueError):
    pass


def scaled(profile: Profile, prefill_factor: float, decode_factor: float) -> Profile:
    """``profile`` with every prefill time multiplied by ``prefill_factor`` (its speeds
    divided by it) and every decode step by ``decode_factor``: a profile corrected by what
    a deployment was seen to do (``router/live_plan.py``)."""
    prefill = [
        msgspec.structs.replace(p, latency_s=p.latency_s * prefill_factor,
                                tokens_per_s=p.tokens_per_s / prefill_factor)
        for p in profile.prefill.prefill
    ]  # fmt: skip
    decode = [msgspec.structs.replace(p, itl_s=p.itl_s * decode_factor)
              for p in profile.decode.decode]  # fmt: skip
    return msgspec.structs.replace(
        profile,
        prefill=msgspec.structs.replace(profile.prefill, prefill=prefill),
        decode=msgspec.structs.replace(profile.decode, decode=decode),
    )


def write_profile(profile: Profile, path: Path) -> None:
    path.write_bytes(msgspec.json.format(msgspec.json.encode(profile), indent=2) + b"\n")


def read_profile(path: Path) -> Profile:
    """The profile at ``path``, checked: a version this code reads, and points to size from
    (prefill speeds, decode steps)."""
    try:
        profile = msgspec.json.decode(path.read_bytes(), type=Profile)
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path}: {exc.strerror}") from None
    except msgspec.ValidationError as exc:
        raise ProfileError(f"{path} is not a pdserve profile: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProfileError(f"{path} is not JSON: {exc}") from None
    if profile.version != PROFILE_VERSION:
        raise ProfileError(
            f"{path} is a version {profile.version} profile; this pdserve reads version "
            f"{PROFILE_VERSION}: profile again"
        )
    if not profile.prefill.prefill:
        raise ProfileError(f"{path} has no prefill points")
    if not profile.decode.decode:
        raise ProfileError(f"{path} has no decode points")
    for point in profile.prefill.prefill:
        if point.isl < 1 or point.latency_s <= 0 or point.tokens_per_s <= 0:
            raise ProfileError(f"{path}: prefill point {point} is not a measurement")
    for point in profile.decode.decode:
        if point.batch < 1 or point.context_tokens < 1 or point.itl_s <= 0:
            raise ProfileError(f"{path}: decode point {point} is not a measurement")
    isls = [p.isl for p in profile.prefill.prefill]
    if len(set(isls)) < len(isls):
        raise ProfileError(f"{path}: prefill points repeat a prompt length: {sorted(isls)}")
    steps = [(p.context_tokens, p.batch) for p in profile.decode.decode]
    if len(set(steps)) < len(steps):
        raise ProfileError(f"{path}: decode points repeat a (context, batch): {sorted(steps)}")
    return profile
