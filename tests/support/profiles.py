"""Profiles with round numbers, for tests that size by hand (``pdserve plan``'s files)."""

from __future__ import annotations

from planner.profile_data import DecodePoint, EngineFacts, PrefillPoint, Profile, RoleProfile


def make_profile(
    *, max_num_seqs: int = 256, kv_capacity_tokens: int = 10_000_000, block_size: int = 16
) -> Profile:
    """Prefill: 1000 prompt tokens a second at any length, alone or loaded (a prompt of
    n tokens takes n ms). Decode: a step of b requests takes 10 + b ms at any context."""
    facts = EngineFacts(block_size, max_num_seqs, 4096, kv_capacity_tokens, 32768, 1,
                        "float32", "cpu")  # fmt: skip
    prefill = [PrefillPoint(isl, isl / 1000, 1000.0) for isl in (100, 1000, 10_000)]
    decode = [DecodePoint(b, c, 0.010 + 0.001 * b) for b in (1, 64, 256) for c in (100, 10_000)]
    return Profile("m", "cpu", "now", RoleProfile(facts, prefill=prefill),
                   RoleProfile(facts, decode=decode))  # fmt: skip
