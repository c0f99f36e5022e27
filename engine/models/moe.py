"""The sparse MLP of mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS).

A router (``gate``: hidden -> one logit per expert) scores each token; the ``top_k``
experts of highest softmax probability each run a SwiGLU MLP on it, and their outputs are
summed weighted by those probabilities (renormalized over the k with ``norm_topk_prob``).
Qwen2-MoE adds a shared expert that every token runs, scaled by
``sigmoid(shared_expert_gate(x))``. GPT-OSS biases the router and the experts, softmaxes over
the top k logits, and clamps its experts' SwiGLU (``arch_parts.MoeConfig``). DeepSeek's router
(``DeepseekGate``) scores by softmax (V2) or sigmoid plus a choice-only bias (V3), limits
the choice to the best groups of experts and scales the weights; its shared experts,
one MLP, are ungated. Nemotron 3 Super's experts run in a narrower latent space
(``MoeConfig.latent_size``): the router and the shared expert read the hidden states,
the routed experts a projection of them, and their weighted sum is projected back.

The experts' weights are stacked, one tensor per projection for all experts
(``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]: transformers 5's
layout; ``loader.py`` fills them from the per-expert tensors that checkpoints store).
Tokens are grouped by expert, so each expert runs one pair of matmuls over exactly the
rows routed to it: k/E of the work of running every expert on every token. With expert
parallelism (``engine.expert_parallel``) a rank holds whole experts in its slots (some of
them copies: ``engine/parallel/expert_placement.py``) and runs only the (token, expert)
pairs routed to them. Off the triton
backend that is ``kernels.reference.moe_experts`` (a loop over experts that reads their
counts on the host: one sync per layer, so no CUDA graphs); on it, the Triton kernel
``kernels.fused_moe`` (sorted and padded on the device, two grouped-GEMM launches with a
static grid: capturable, so MoE models decode in CUDA graphs there).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.arch import ModelArchConfig
from engine.models.arch_parts import MoeConfig
from engine.parallel.expert_placement import replica_table
from kernels.reference import moe_experts


class Experts(nn.Module):
    """The routed experts' weights, stacked (a holder: ``SparseMoe`` runs them)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        gated: bool = True,
    ) -> None:
        super().__init__()
        rows = (2 if gated else 1) * intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, rows, hidden_size)
        )  # [E, 2I, H]: gate rows, then up rows ([E, I, H] up rows alone: ungated)
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size)
        )  # [E, H, I]
        self.gate_up_proj_bias = self.down_proj_bias = None
        if bias:  # GPT-OSS
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))


class DeepseekGate(nn.Module):
    """DeepSeek's router: its logits and scores in float32 (the loader keeps this module in
    float32, as transformers does), the choice as ``MoeConfig.deepseek_scoring`` says."""

    def __init__(self, moe: MoeConfig, hidden_size: int) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        # V3: added to the scores to choose experts (balancing load), not to their weights.
        self.e_score_correction_bias = None
        if moe.deepseek_scoring == "sigmoid":
            self.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts))

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [num_tokens, k] int64, their weights [num_tokens, k] float32)."""
        moe = self.moe
        v3 = self.e_score_correction_bias is not None  # sigmoid scores (V3, GLM-4.5)
        logits = F.linear(hidden.float(), self.weight.float())  # [T, E]
        if v3:
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
        else:
            scores = choice = logits.softmax(dim=-1)
        if moe.num_groups > 1:
            grouped = choice.view(choice.shape[0], moe.num_groups, -1)  # [T, G, E / G]
            # A group's rank: the sum of its two best (V3), or its best (V2).
            if v3:
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            else:
                group_scores = grouped.amax(dim=-1)
            kept = group_scores.topk(moe.topk_groups, dim=-1).indices  # [T, topk_groups]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            # V3 rules the other groups' experts out; V2 zeroes their softmax scores.
            outside = float("-inf") if v3 else 0.0
            choice = grouped.masked_fill(~keep[..., None], outside).flatten(1)
        expert_ids = choice.topk(moe.top_k, dim=-1).indices
        weights = scores.gather(1, expert_ids)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return expert_ids, weights * moe.routed_scaling_factor


def slots_of_pairs(
    expert_ids: torch.Tensor, replica_slots: torch.Tensor, replica_counts: torch.Tensor
) -> torch.Tensor:
    """This rank's slot for each (token, expert) pair (``expert_ids`` [T, k] -> [T, k]),
    ``S`` where another rank's replica runs it: token t's pair with an expert of c
    replicas goes to replica t % c, as ``replica_slots`` [E, R + 1] names them on this
    rank (``expert_placement.replica_table``). Every rank makes the same choice, so exactly
    one runs each pair, and an expert's copies share its pairs. (By token, not by pair:
    a pair's flat index would send every pair in one top-k column to one replica.)"""
    tokens = torch.arange(expert_ids.shape[0], device=expert_ids.device)[:, None]  # [T, 1]
    return replica_slots[expert_ids, tokens % replica_counts[expert_ids]]


class SparseMoe(nn.Module):
    """Router + routed experts (+ the gated shared expert, when the model has one)."""

    def __init__(
        self, arch: ModelArchConfig, shared_expert: nn.Module | None, fused: bool = False
    ) -> None:
        """``fused``: run the experts with the Triton kernel (``kernels/fused_moe.py``, the
        triton backend's choice), else with ``kernels.reference.moe_experts``."""
        super().__init__()
        moe = arch.moe
        assert moe is not None
        self.fused = fused
        run_experts = moe_experts
        if fused:
            from kernels.fused_moe import fused_moe  # imports triton: only when chosen

            run_experts = fused_moe
        # (the layer's activation bound once: SwiGLU, or Nemotron-H's squared ReLU)
        self._run_experts = functools.partial(run_experts, activation=moe.expert_activation)
        self.moe = moe
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.weights_in_model_dtype = moe.routing_weights_in_model_dtype
        # The router (GPT-OSS's checkpoints call it ``router``; the loader renames).
        self.gate: nn.Module
        if moe.deepseek_scoring is not None:
            self.gate = DeepseekGate(moe, arch.hidden_size)
        else:
            self.gate = nn.Linear(arch.hidden_size, moe.num_experts, bias=moe.router_bias)
        # Latent experts (Nemotron 3 Super): hidden -> latent before them, back after. Every
        # rank holds both projections; the experts' partial sums (their intermediate
        # split, or this rank's experts) stay partial through the second, as it has no
        # bias, for the layer's all-reduce to add up.
        self.fc1_latent_proj = self.fc2_latent_proj = None
        expert_width = arch.hidden_size
        if moe.latent_size is not None:
            expert_width = moe.latent_size
            self.fc1_latent_proj = nn.Linear(arch.hidden_size, moe.latent_size, bias=False)
            self.fc2_latent_proj = nn.Linear(moe.latent_size, arch.hidden_size, bias=False)
        # Expert parallelism: this rank's slots of whole experts (every expert without it).
        self.num_local_experts = moe.local_experts
        self.experts = Experts(
            moe.local_experts, expert_width, moe.expert_intermediate_size, moe.expert_bias,
            gated=moe.expert_activation == "swiglu",
        )  # fmt: skip
        # The placement this layer runs (``engine/parallel/expert_placement.py``), and as
        # device tables (filled by ``set_placement``): each expert's replicas as this
        # rank's slots (num_local_experts: another rank's) and their count.
        self.expert_placement = moe.expert_placement
        if moe.expert_placement is not None:
            width = len(moe.expert_placement) - moe.num_experts + 1
            self.register_buffer(
                "replica_slots", torch.empty(moe.num_experts, width, dtype=torch.int64),
                persistent=False,
            )  # fmt: skip
            self.register_buffer(
                "replica_counts", torch.empty(moe.num_experts, dtype=torch.int64), persistent=False
            )
        # Pairs routed to each expert [num_experts] int64, counted while set (by
        # ``ModelShard``, for rebalancing); the reader zeroes it.
        self.expert_load: torch.Tensor | None = None
        # While a decode graph runs this layer ([rows] int64: 1 for a real row, 0 for the
        # padding up to its bucket), the pairs of each row count that much, not 1.
        self.counted_rows: torch.Tensor | None = None
        self.shared_expert = shared_expert
        # Qwen2-MoE gates its shared expert per token; DeepSeek's shared experts are not.
        self.shared_expert_gate = None
        if shared_expert is not None and moe.deepseek_scoring is None and moe.shared_expert_gated:
            self.shared_expert_gate = nn.Linear(arch.hidden_size, 1, bias=False)

    def set_placement(self, placement: tuple[int, ...]) -> None:
        """Run ``placement`` from now on (the weights in the slots must already be its)."""
        moe = self.moe
        slots, counts = replica_table(
            placement, moe.num_experts, moe.expert_rank, moe.num_expert_ranks
        )
        self.replica_slots.copy_(torch.tensor(slots))  # in place: CUDA graphs read these
        self.replica_counts.copy_(torch.tensor(counts))
        self.expert_placement = placement

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [num_tokens, k] int64, their weights [num_tokens, k])."""
        if isinstance(self.gate, DeepseekGate):
            return self.gate(hidden)
        if self.moe.softmax_over_top_k:  # GPT-OSS, in the model dtype as transformers
            top_logits, expert_ids = self.gate(hidden).topk(self.top_k, dim=-1)
            return expert_ids, torch.softmax(top_logits, dim=-1)
        probs = torch.softmax(self.gate(hidden), dim=-1, dtype=torch.float32)  # [T, E]
        weights, expert_ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(hidden.dtype)
        return expert_ids, weights

    def forward(self, hidden: torch.Tensor, lora: object = None) -> torch.Tensor:
        """``hidden`` [num_tokens, H] -> [num_tokens, H]. ``lora`` is accepted for the
        dense MLP's signature and unused: adapters on expert layers are refused at load."""
        expert_ids, weights = self.route(hidden)  # [T, k]
        if self.expert_load is not None:
            flat = expert_ids.flatten()
            counts = torch.ones_like(flat)
            if self.counted_rows is not None:  # a decode graph's: its padding rows are 0
                rows = self.counted_rows[: expert_ids.shape[0]]
                counts = rows.repeat_interleave(expert_ids.shape[1])
            self.expert_load.index_add_(0, flat, counts)
        other_experts = self.expert_placement is not None
        if other_experts:
            # Other ranks' slots are id num_local_experts, which the kernels skip: this
            # rank adds its slots' share, the layer's all-reduce the others'.
            expert_ids = slots_of_pairs(expert_ids, self.replica_slots, self.replica_counts)
        experts = self.experts
        gate_up, down = experts.gate_up_proj, experts.down_proj
        expert_in = hidden if self.fc1_latent_proj is None else self.fc1_latent_proj(hidden)
        out = self._run_experts(
            expert_in, gate_up, down, expert_ids, weights,
            gate_up_bias=experts.gate_up_proj_bias, down_bias=experts.down_proj_bias,
            swiglu_limit=self.moe.swiglu_limit, swiglu_alpha=self.moe.swiglu_alpha,
            other_experts=other_experts,
        )  # fmt: skip
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)  # [T, latent] -> [T, H]
        if self.shared_expert is not None:
            shared = self.shared_expert(hidden)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(hidden)) * shared
            out = out + shared
        return out
