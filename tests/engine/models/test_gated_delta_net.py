"""The gated delta rule's chunked form against its token-by-token recurrence, and against
transformers' own chunked form (which normalizes q and k inside)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.gated_delta_net import _l2_normalized, chunked_delta_rule, delta_rule_step

HEADS, DK, DV = 3, 8, 6


def inputs(length: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    query = _l2_normalized(randn(length, HEADS, DK)) * DK**-0.5
    key = _l2_normalized(randn(length, HEADS, DK))
    decay = -F.softplus(randn(length, HEADS))  # log decays <= 0
    beta = randn(length, HEADS).sigmoid()
    return query, key, randn(length, HEADS, DV), decay, beta, randn(HEADS, DK, DV)


@pytest.mark.parametrize("length,chunk", [(1, 64), (5, 64), (64, 64), (130, 64), (37, 16)])
def test_chunked_form_equals_the_recurrence(length, chunk):
    """Partial and whole chunks, from a nonzero state: every output and the final state."""
    query, key, value, decay, beta, state = inputs(length, length)
    out, final = chunked_delta_rule(query, key, value, decay, beta, state, chunk)
    expected = []
    current = state[None]
    for t in range(length):
        step_out, current = delta_rule_step(
            query[t : t + 1], key[t : t + 1], value[t : t + 1], decay[t : t + 1],
            beta[t : t + 1], current,
        )  # fmt: skip
        expected.append(step_out[0])
    torch.testing.assert_close(out, torch.stack(expected), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, current[0], atol=1e-5, rtol=1e-5)


def test_two_pieces_equal_one():
    """A prompt computed in two chunks (the state carried between) equals it in one."""
    query, key, value, decay, beta, state = inputs(90, 7)
    whole, final = chunked_delta_rule(query, key, value, decay, beta, state)
    first, middle = chunked_delta_rule(*(x[:33] for x in (query, key, value, decay, beta)), state)
    second, end = chunked_delta_rule(*(x[33:] for x in (query, key, value, decay, beta)), middle)
    torch.testing.assert_close(torch.cat((first, second)), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end, final, atol=1e-5, rtol=1e-5)


def test_equals_transformers_chunked_form():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    generator = torch.Generator().manual_seed(3)
    raw_q, raw_k = torch.randn(2, 70, HEADS, DK, generator=generator)
    value = torch.randn(70, HEADS, DV, generator=generator)
    decay = -F.softplus(torch.randn(70, HEADS, generator=generator))
    beta = torch.randn(70, HEADS, generator=generator).sigmoid()
    state = torch.randn(HEADS, DK, DV, generator=generator)
    expected, expected_state = torch_chunk_gated_delta_rule(
        raw_q[None], raw_k[None], value[None], decay[None], beta[None],
        initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    query = _l2_normalized(raw_q) * DK**-0.5
    out, final = chunked_delta_rule(query, _l2_normalized(raw_k), value, decay, beta, state)
    torch.testing.assert_close(out, expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, expected_state[0], atol=1e-5, rtol=1e-5)
