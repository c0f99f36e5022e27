"""Rotary position embeddings, computed exactly as transformers computes them (float32)."""

from __future__ import annotations

import math

import torch

from engine.models.rope_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:  # [rotary_dim // 2]
    dim = rope.rotary_dim(head_dim)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if rope.rope_type == "yarn":
        return _yarn_inverse_frequencies(rope, dim)
    assert rope.rope_type == "default", rope.rope_type
    return inv_freq


def _yarn_inverse_frequencies(rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN: dimensions that rotate fewer than ``beta_slow`` times over the pretraining
    context are interpolated (divided by ``factor``), those rotating more than ``beta_fast``
    times are kept, and a linear ramp blends the ones between (as transformers computes it)."""

    def correction_dim(num_rotations: float) -> float:
        ratio = rope.original_max_position_embeddings / (num_rotations * 2 * math.pi)
        return dim * math.log(ratio) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # weight of the unscaled frequency per dimension pair
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation


class RotaryEmbedding(torch.nn.Module):
    """A cos/sin table for every position up to ``max_positions``, indexed per token.

    The tables are built by ``build_tables`` once the module sits on its final device (the
    loader creates the model on the meta device first, so nothing is computed twice).

    With M-RoPE sections (Qwen2.5-VL, Qwen3-VL) positions may be ``[3, num_tokens]``: a
    token's time, row and column; frequency pair i takes its angle from the row its section
    names (``mrope_rows``). A token whose three are equal (all text) rotates as with one."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.rope, self.head_dim, self.max_positions = rope, head_dim, max_positions
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.register_buffer("mrope_rows", torch.empty(0, dtype=torch.int64), persistent=False)

    def build_tables(self, device: torch.device) -> None:
        """(Re)compute the float32 tables; call after the module moved or changed dtype."""
        inv_freq = inverse_frequencies(self.rope, self.head_dim)
        positions = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, rotary_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, rotary_dim]
        scale = self.rope.attention_factor
        self.cos = (emb.cos() * scale).to(device)
        self.sin = (emb.sin() * scale).to(device)
        if self.rope.mrope_section is not None:  # [rotary_dim]: 0, 1 or 2 per dimension
            pairs = mrope_pair_rows(self.rope.mrope_section, self.rope.mrope_interleaved)
            self.mrope_rows = torch.cat((pairs, pairs)).to(device)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens], or [3, num_tokens] (M-RoPE)
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos[positions], self.sin[positions]  # [(3,) num_tokens, rotary_dim]
        if positions.dim() == 2:  # each dimension's angle from its section's row
            rows = self.mrope_rows.expand(1, positions.shape[1], -1)
            cos, sin = cos.gather(0, rows)[0], sin.gather(0, rows)[0]
        cos = cos.to(query.dtype)[:, None, :]  # [num_tokens, 1, rotary_dim]
        sin = sin.to(query.dtype)[:, None, :]
        rotary_dim = cos.shape[-1]
        if rotary_dim == self.head_dim:
            return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin
        # Partial rotary: the first rotary_dim dims of each head rotate, the rest pass.
        q_rot, q_pass = query[..., :rotary_dim], query[..., rotary_dim:]
        k_rot, k_pass = key[..., :rotary_dim], key[..., rotary_dim:]
        query = torch.cat((q_rot * cos + _rotate_half(q_rot) * sin, q_pass), dim=-1)
        key = torch.cat((k_rot * cos + _rotate_half(k_rot) * sin, k_pass), dim=-1)
        return query, key


def mrope_pair_rows(sections: tuple[int, ...], interleaved: bool) -> torch.Tensor:
    """[sum(sections)] int64: the position row (0 time, 1 row, 2 column) each frequency
    pair rotates by: three contiguous sections, or interleaved as Qwen3-VL's
    (``RopeConfig.mrope_interleaved``)."""
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(sections))
    rows = torch.zeros(sum(sections), dtype=torch.int64)
    for row in (1, 2):
        rows[row : 3 * sections[row] : 3] = row
    return rows


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
