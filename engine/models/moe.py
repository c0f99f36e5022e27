"""The sparse MLP of mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE).

A router (``gate``: hidden -> one logit per expert) scores each token; the ``top_k``
experts of highest softmax probability each run a SwiGLU MLP on it, and their outputs are
summed weighted by those probabilities (renormalized over the k with ``norm_topk_prob``).
Qwen2-MoE adds a shared expert that every token runs, scaled by
``sigmoid(shared_expert_gate(x))``.

The experts' weights are stacked, one tensor per projection for all experts
(``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]: transformers 5's
layout; ``loader.py`` fills them from the per-expert tensors that checkpoints store).
Tokens are grouped by expert, so each expert runs one pair of matmuls over exactly the
rows routed to it: k/E of the work of running every expert on every token. The grouping
reads the per-expert counts on the host, one sync per layer; that is why MoE models decode
without CUDA graphs (``model_runner.py``). A fused kernel with a static grid (tokens
sorted and padded per expert on the device) is the GPU answer; it is not built yet.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.arch import ModelArchConfig


class Experts(nn.Module):
    """The routed experts' weights, stacked."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )  # [E, 2I, H]: gate rows, then up rows
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size)
        )  # [E, H, I]

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, H]
        expert_ids: torch.Tensor,  # [num_tokens, k] int64, distinct per row
        weights: torch.Tensor,  # [num_tokens, k]
    ) -> torch.Tensor:  # [num_tokens, H]
        top_k = expert_ids.shape[1]
        flat_ids = expert_ids.reshape(-1)  # [num_tokens * k]: one slot per (token, choice)
        order = torch.argsort(flat_ids, stable=True)  # slots grouped by expert
        counts = torch.bincount(flat_ids, minlength=self.gate_up_proj.shape[0]).tolist()
        token_of_slot = order // top_k  # [num_tokens * k]
        weight_of_slot = weights.reshape(-1)[order].unsqueeze(-1)  # [num_tokens * k, 1]
        out = torch.zeros_like(hidden)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            tokens = token_of_slot[start : start + count]  # [count]
            gate, up = F.linear(hidden[tokens], self.gate_up_proj[expert]).chunk(2, dim=-1)
            expert_out = F.linear(F.silu(gate) * up, self.down_proj[expert])  # [count, H]
            expert_out = expert_out * weight_of_slot[start : start + count]
            # Each token meets each expert at most once, and experts are added in index
            # order: the sum per token is transformers' own, bit for bit on the same rows.
            out.index_add_(0, tokens, expert_out.to(out.dtype))
            start += count
        return out


class SparseMoe(nn.Module):
    """Router + routed experts (+ the gated shared expert, when the model has one)."""

    def __init__(self, arch: ModelArchConfig, shared_expert: nn.Module | None) -> None:
        super().__init__()
        moe = arch.moe
        assert moe is not None
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.weights_in_model_dtype = moe.routing_weights_in_model_dtype
        self.gate = nn.Linear(arch.hidden_size, moe.num_experts, bias=False)
        self.experts = Experts(moe.num_experts, arch.hidden_size, moe.expert_intermediate_size)
        self.shared_expert = shared_expert
        if shared_expert is not None:
            self.shared_expert_gate = nn.Linear(arch.hidden_size, 1, bias=False)

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [num_tokens, k] int64, their weights [num_tokens, k])."""
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
        expert_ids, weights = self.route(hidden)
        out = self.experts(hidden, expert_ids, weights)
        if self.shared_expert is not None:
            shared = self.shared_expert(hidden)
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * shared
        return out
