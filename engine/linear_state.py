"""The recurrent states of a hybrid model's linear-attention layers (Qwen3.5's gated
delta-rule layers, ``models/gated_delta_net.py``; Granite 4.0-H's Mamba-2 layers,
``models/mamba2.py``), and which request holds which.

A linear-attention layer keeps no KV: each request has, per such layer, a convolution
state ``[conv_dim, conv_kernel - 1]`` and a recurrent state (``[num_value_heads,
key_head_dim, value_head_dim]``; Mamba-2's ``[num_heads, head_dim, state_size]``: the
configs' ``conv_shape`` and ``ssm_shape``), whatever its length. They live in float32
(or 16 bits: ``engine.linear_state_dtype``; the layers compute in float32), slot-major:
``[num_slots, num_linear_layers, conv + recurrent elements]``, each layer reading views of
its slice (``StatePool.layer``), and that pool is the tail of the KV cache itself: slot
``s`` is the bytes of ``blocks_per_slot`` KV blocks past the scheduler's ``num_blocks``
(``StatePool.block_ids``). So the KV connectors move a request's states as they move its
prompt's blocks, bit for bit, with nothing of their own: a prefill worker keeps the slot
of a request it holds for a decode worker and exports its blocks with the prompt's; the
decode worker pulls them into a slot of its own (``LLMEngine._start_fetches``).

``StateSlots`` gives a request a slot when it starts computing from its first token (its
states start at zero), or when its states are pulled, and keeps it while it holds KV
blocks; the slot goes back when the request's blocks are freed (it ended, was aborted or
preempted, or a decode worker pulled what it held: ``Scheduler.on_blocks_freed``). A
preempted request recomputes from its first token, so its states are rebuilt. A state
depends on every token before it, so a prefix-cache hit restores one only from a snapshot
of the states after that prefix, which the prefix cache keeps in blocks of its own
(``kv_cache_manager.py``): ``StatePool.snapshot`` copies a slot into them after the step
that reached the prefix's end, ``StatePool.restore`` copies them into a new request's slot
before its first step. A decode verifying drafts keeps its states after each token in
slots of its own (``LinearStep.verify``) until its next step shows which to keep: a
group of ``num_speculative_tokens`` draft slots, held from that step on (``DraftGroups``;
there may be fewer groups than request slots: ``engine.max_num_verifying_seqs``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.models.arch_parts import LinearAttentionConfig, Mamba2Config


@dataclass(frozen=True, slots=True)
class VerifyPlan:
    """How a step's decodes with drafts (a segment of n tokens each: a token and its
    drafts) run one position at a time, all of them together, keeping the states after
    each token (the sampler may keep any number of the drafts): which sequences of the
    step they are, their own slots (their states before the step), and per position p,
    the rows of the sequences that have a token there, their index among the sequences,
    and the slot that keeps the states after it (a draft slot, or the sequence's own
    after its last token). Built once per step, read by every layer."""

    seqs: frozenset[int]  # the verifying sequences' indices in the step
    slots: torch.Tensor  # [num_verifying] int64
    rows: list[torch.Tensor]  # per position: [n_p] int64 rows of the step
    active: list[torch.Tensor]  # per position: [n_p] int64 indices into ``slots``
    kept: list[torch.Tensor]  # per position: [n_p] int64 slots


def verify_plan(
    draft_slots: dict[int, list[int]],
    slots: list[int],
    query_start_loc: list[int],
    device: torch.device,
) -> VerifyPlan:
    """The ``VerifyPlan`` of a step's sequences with drafts (sequence index -> the draft
    slots of its tokens but the last), ``slots`` / ``query_start_loc`` the step's."""
    seqs = sorted(draft_slots)
    lengths = [query_start_loc[seq + 1] - query_start_loc[seq] for seq in seqs]
    rows, active, kept = [], [], []
    for position in range(max(lengths)):
        members = [i for i, length in enumerate(lengths) if length > position]
        rows.append([query_start_loc[seqs[i]] + position for i in members])
        active.append(members)
        kept.append([slots[seqs[i]] if position == lengths[i] - 1
                     else draft_slots[seqs[i]][position] for i in members])  # fmt: skip

    def tensors(lists: list[list[int]]) -> list[torch.Tensor]:
        return [torch.tensor(values, dtype=torch.int64, device=device) for values in lists]

    own = torch.tensor([slots[seq] for seq in seqs], dtype=torch.int64, device=device)
    return VerifyPlan(frozenset(seqs), own, tensors(rows), tensors(active), tensors(kept))


@dataclass(frozen=True, slots=True)
class LinearStep:
    """What a step's linear-attention layers need of its batch: each sequence's slot
    (segments ordered as the batch: the ``num_decodes`` single-token ones first), and
    how its decodes verifying drafts run (``verify``; None without any): they keep their
    states after each token, so that the next step can start from the last token the
    sampler kept (``StatePool.copy_slot``)."""

    slots: torch.Tensor  # [num_seqs] int64, on the device
    slots_cpu: list[int]
    query_start_loc_cpu: list[int]
    num_decodes: int
    verify: VerifyPlan | None = None

    def verifies(self, seq: int) -> bool:
        """Whether sequence ``seq`` verifies drafts (``verify`` runs it)."""
        return self.verify is not None and seq in self.verify.seqs


@dataclass(frozen=True, slots=True)
class LinearLayerState:
    """One layer's states of every slot (views into the pool) and the step's slots."""

    conv: torch.Tensor  # [num_slots, conv_dim, conv_kernel - 1], the pool's dtype
    # [num_slots, num_value_heads, key_head_dim, value_head_dim]; Mamba-2's
    # [num_slots, num_heads, head_dim, state_size]
    ssm: torch.Tensor
    step: LinearStep


def bytes_per_slot(
    linear: LinearAttentionConfig | Mamba2Config, dtype: torch.dtype = torch.float32
) -> int:
    """Bytes of one request's states over all linear-attention layers, kept in ``dtype``
    (``engine.linear_state_dtype``)."""
    return dtype.itemsize * _elements_per_layer(linear) * sum(linear.layers)


def _elements_per_layer(linear: LinearAttentionConfig | Mamba2Config) -> int:
    return math.prod(linear.conv_shape) + math.prod(linear.ssm_shape)


class StatePool:
    """Every slot's states, for every linear-attention layer of the model: views of the
    ``num_slots * blocks_per_slot`` KV blocks from ``first_block`` on (``kv_caches``: per
    layer a view of one block-major buffer, ``host_memory.zeros_for_kv_caches``)."""

    def __init__(
        self,
        linear: LinearAttentionConfig | Mamba2Config,
        num_slots: int,
        kv_caches: list[torch.Tensor],
        first_block: int,
        blocks_per_slot: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.num_slots = num_slots
        self.first_block = first_block
        self.blocks_per_slot = blocks_per_slot
        self.conv_shape = linear.conv_shape
        self.ssm_shape = linear.ssm_shape
        self.conv_elements = math.prod(linear.conv_shape)
        per_layer = _elements_per_layer(linear)
        num_layers = sum(linear.layers)
        self.block_bytes = block_bytes(kv_caches)  # every KV block, slots' and others'
        blocks = self.block_bytes[first_block : first_block + num_slots * blocks_per_slot]
        if blocks.numel() < num_slots * bytes_per_slot(linear, dtype):
            raise ValueError(f"{blocks.shape[0]} KV blocks cannot hold {num_slots} state slots")
        # [num_slots, blocks_per_slot * block_bytes / itemsize] of ``dtype``; a slot's
        # states first.
        slots = blocks.reshape(num_slots, -1).view(dtype)
        self.states = slots[:, : num_layers * per_layer].view(num_slots, num_layers, per_layer)

    def layer(self, index: int, step: LinearStep) -> LinearLayerState:
        """The states of linear-attention layer ``index`` (its order among them)."""
        states = self.states[:, index]  # [num_slots, per_layer]
        conv = states[:, : self.conv_elements].view(self.num_slots, *self.conv_shape)
        ssm = states[:, self.conv_elements :].view(self.num_slots, *self.ssm_shape)
        return LinearLayerState(conv, ssm, step)

    def block_ids(self, slot: int) -> list[int]:
        """The KV blocks that hold slot ``slot``'s states (what a transfer moves)."""
        first = self.first_block + slot * self.blocks_per_slot
        return list(range(first, first + self.blocks_per_slot))

    def restore(self, slot: int, block_ids: list[int]) -> None:
        """Slot ``slot``'s states from a snapshot's blocks (``snapshot``'s ids)."""
        self._copy(block_ids, self.block_ids(slot))

    def snapshot(self, slot: int, block_ids: list[int]) -> None:
        """Copy slot ``slot``'s states into ``blocks_per_slot`` KV blocks of the pool's
        (a prefix-cache snapshot: ``engine/kv_cache_manager.py``)."""
        self._copy(self.block_ids(slot), block_ids)

    def copy_slot(self, source: int, dest: int) -> None:
        """Slot ``dest``'s states become slot ``source``'s (a decode that verified drafts
        continues from the states after the last token the sampler kept)."""
        self._copy(self.block_ids(source), self.block_ids(dest))

    def _copy(self, source: list[int], dest: list[int]) -> None:
        assert len(source) == len(dest) == self.blocks_per_slot, (len(source), len(dest))
        device = self.block_bytes.device
        rows = self.block_bytes[torch.tensor(source, dtype=torch.int64, device=device)]
        self.block_bytes.index_copy_(0, torch.tensor(dest, dtype=torch.int64, device=device), rows)

    def clear(self, slots: list[int]) -> None:
        """Zero these slots' states (requests starting from their first token)."""
        if slots:
            index = torch.tensor(slots, dtype=torch.int64, device=self.states.device)
            self.states.index_fill_(0, index, 0.0)


def block_bytes(kv_caches: list[torch.Tensor]) -> torch.Tensor:
    """[num_blocks, bytes of a block over all layers] uint8: the block-major buffer the
    per-layer views share (``host_memory.zeros_for_kv_caches``)."""
    first = kv_caches[0]
    num_blocks, block_elements = first.shape[0], first.stride(0)
    if len(kv_caches) * first[0].numel() != block_elements:
        raise ValueError("the KV caches are not views of one block-major buffer")
    size = first.element_size()
    flat = torch.empty(0, dtype=torch.uint8, device=first.device)
    flat.set_(first.untyped_storage(), first.storage_offset() * size,
              (num_blocks * block_elements * size,))  # fmt: skip
    return flat.view(num_blocks, block_elements * size)


class StateSlots:
    """Which request holds which slot. Engine thread only."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slots: dict[str, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))

    def reserve(self, request_id: str) -> int:
        """The request's slot: the one it holds, else a free one (its states start over,
        or arrive from another worker: a pull)."""
        slot = self._slots.get(request_id)
        if slot is None:
            if not self._free:
                raise RuntimeError(f"no free state slot for {request_id}: all "
                                   f"{self.num_slots} are held")  # fmt: skip
            slot = self._free.pop()
            self._slots[request_id] = slot
        return slot

    def slot(self, request_id: str) -> int | None:
        return self._slots.get(request_id)

    def assign(self, request_id: str, start_pos: int) -> tuple[int, bool]:
        """The slot of a request whose chunk starts at ``start_pos``, and whether its
        states must start from zero (its first token: a new slot, or its own again after
        it restarted). Raises ``RuntimeError`` for a request that continues without its
        states (none hold what its earlier tokens wrote)."""
        if start_pos == 0:
            return self.reserve(request_id), True
        slot = self._slots.get(request_id)
        if slot is None:
            raise RuntimeError(
                f"request {request_id} continues at position {start_pos} but holds no "
                "linear-attention state (its earlier tokens were not computed here)"
            )
        return slot, False

    def rename(self, request_id: str, holder: str) -> None:
        """Hand the request's slot (if any) to ``holder``, which keeps it until released
        under its own name: a late pull may still write the slot's state blocks."""
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            assert holder not in self._slots, holder
            self._slots[holder] = slot

    def release(self, request_id: str) -> None:
        """The request's blocks were freed; a no-op if it holds no slot."""
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    @property
    def num_used(self) -> int:
        return len(self._slots)


class DraftGroups(StateSlots):
    """Which request holds which group of draft slots (``ModelShard.draft_slots``; a
    group's index is what ``reserve`` / ``slot`` return): from the step in which it
    verifies drafts until its next step has taken the states after the last token the
    sampler kept (``ModelRunner._accepted``) without verifying again, or its slot goes.
    The scheduler gives a decode drafts only if it holds a group or one is free
    (``can_verify``), so fewer groups than request slots cap how many requests verify
    at once. Engine thread only."""

    def can_verify(self, request_id: str) -> bool:
        return self.slot(request_id) is not None or bool(self._free)
