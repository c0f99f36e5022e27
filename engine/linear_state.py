"""The recurrent states of a hybrid model's linear-attention layers (Qwen3.5's gated
delta-rule layers, ``models/gated_delta_net.py``), and which request holds which.

A linear-attention layer keeps no KV: each request has, per such layer, a convolution
state ``[conv_dim, conv_kernel - 1]`` and a recurrent state ``[num_value_heads,
key_head_dim, value_head_dim]``, whatever its length. They live in one float32 pool,
slot-major: ``[num_slots, num_linear_layers, conv + recurrent elements]``, so that one
request's states are one contiguous range (what moving them as one piece needs), and each
layer reads views of its slice (``StatePool.layer``).

``StateSlots`` gives a request a slot when it starts computing from its first token (its
states start at zero) and keeps it while it continues; the slot goes back when the request
ends or is preempted (a preempted request recomputes from its first token, so its states
are rebuilt). A state depends on every token before it, so a prefix-cache hit cannot
restore one: hybrid models run without the prefix cache (``LLMEngine``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models.arch import LinearAttentionConfig


@dataclass(frozen=True, slots=True)
class LinearStep:
    """What a step's linear-attention layers need of its batch: each sequence's slot
    (segments ordered as the batch: the ``num_decodes`` single-token ones first)."""

    slots: torch.Tensor  # [num_seqs] int64, on the device
    slots_cpu: list[int]
    query_start_loc_cpu: list[int]
    num_decodes: int


@dataclass(frozen=True, slots=True)
class LinearLayerState:
    """One layer's states of every slot (views into the pool) and the step's slots."""

    conv: torch.Tensor  # [num_slots, conv_dim, conv_kernel - 1] float32
    ssm: torch.Tensor  # [num_slots, num_value_heads, key_head_dim, value_head_dim] float32
    step: LinearStep


class StatePool:
    """Every slot's states, for every linear-attention layer of the model."""

    def __init__(self, linear: LinearAttentionConfig, num_slots: int, device: torch.device) -> None:
        self.linear = linear
        self.num_slots = num_slots
        self.conv_shape = (linear.conv_dim, linear.conv_kernel - 1)
        self.ssm_shape = (linear.num_value_heads, linear.key_head_dim, linear.value_head_dim)
        self.conv_elements = linear.conv_dim * (linear.conv_kernel - 1)
        num_layers = sum(linear.layers)
        width = self.conv_elements + self.ssm_shape[0] * self.ssm_shape[1] * self.ssm_shape[2]
        self.states = torch.zeros(num_slots, num_layers, width, dtype=torch.float32, device=device)

    @staticmethod
    def bytes_per_slot(linear: LinearAttentionConfig) -> int:
        """float32 bytes of one request's states over all linear-attention layers."""
        per_layer = linear.conv_dim * (linear.conv_kernel - 1) + (
            linear.num_value_heads * linear.key_head_dim * linear.value_head_dim
        )
        return 4 * per_layer * sum(linear.layers)

    def layer(self, index: int, step: LinearStep) -> LinearLayerState:
        """The states of linear-attention layer ``index`` (its order among them)."""
        states = self.states[:, index]  # [num_slots, width]
        conv = states[:, : self.conv_elements].view(self.num_slots, *self.conv_shape)
        ssm = states[:, self.conv_elements :].view(self.num_slots, *self.ssm_shape)
        return LinearLayerState(conv, ssm, step)

    def clear(self, slots: list[int]) -> None:
        """Zero these slots' states (requests starting from their first token)."""
        if slots:
            index = torch.tensor(slots, dtype=torch.int64, device=self.states.device)
            self.states.index_fill_(0, index, 0.0)


class StateSlots:
    """Which request holds which slot. Engine thread only."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slots: dict[str, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))

    def assign(self, request_id: str, start_pos: int) -> tuple[int, bool]:
        """The slot of a request whose chunk starts at ``start_pos``, and whether its
        states must start from zero (its first token: a new slot, or its own again after
        it restarted). Raises ``RuntimeError`` for a request that continues without its
        states (none hold what its earlier tokens wrote)."""
        slot = self._slots.get(request_id)
        if start_pos == 0:
            if slot is None:
                if not self._free:
                    raise RuntimeError(f"no free state slot for {request_id}: all "
                                       f"{self.num_slots} are held")  # fmt: skip
                slot = self._free.pop()
                self._slots[request_id] = slot
            return slot, True
        if slot is None:
            raise RuntimeError(
                f"request {request_id} continues at position {start_pos} but holds no "
                "linear-attention state (its earlier tokens were not computed here)"
            )
        return slot, False

    def release(self, request_id: str) -> None:
        """The request ended or was preempted; a no-op if it holds no slot."""
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    @property
    def num_used(self) -> int:
        return len(self._slots)
