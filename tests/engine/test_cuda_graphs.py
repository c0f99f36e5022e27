"""Decode graphs without a GPU: capture and replay emulated, a replay running the
captured forward again over the same static buffers (what a graph replays), so the host
side (buckets, padding, the buffers a step fills) is checked here; the graphs themselves
run only on CUDA (``tests/engine/test_triton_backend.py``'s ``gpu`` cases)."""

from __future__ import annotations

import pytest
import torch

import tests.kernels.triton_env  # noqa: F401  (sets TRITON_INTERPRET before kernels load)

# isort: split

from engine import LLM, SamplingParams
from engine.cuda_graphs import DecodeGraphs
from engine.models.moe import SparseMoe
from tests.engine.helpers import random_prompts


class _Replay:
    """A captured bucket: replaying runs its forward again into the captured output."""

    def __init__(self, graphs: DecodeGraphs, batch: int, hidden: torch.Tensor) -> None:
        self.graphs, self.batch, self.hidden = graphs, batch, hidden

    def replay(self) -> None:
        with torch.inference_mode():
            self.hidden.copy_(self.graphs._forward(self.batch))


def _emulated_capture(self: DecodeGraphs) -> None:
    self.slot_mapping.fill_(-1)
    self.seq_lens.zero_()
    with torch.inference_mode():
        for batch in reversed(self.buckets):
            replay = _Replay(self, batch, self._forward(batch).clone())
            self.graphs[batch] = (replay, replay.hidden)


@pytest.mark.timeout(600)
def test_replayed_decodes_count_their_real_rows_only(model_factory, monkeypatch):
    """Expert rebalancing reads the pairs routed to each expert: replays counted their
    padding rows too, all alike and all routed to the same experts (an audit: 35 rows a
    layer where 33 were real). Three prompts decode one step together, padded to the
    bucket of 4: each layer routes k pairs for each of their tokens, no more."""
    llm = LLM(model_factory("qwen3_moe"), attention_backend="triton", device="cpu",
              dtype="float32", num_blocks=64, max_model_len=128, max_num_seqs=4)  # fmt: skip
    shard = llm.engine.runner.shard
    shard.moe_layers = [m for m in shard.model.modules() if isinstance(m, SparseMoe)]
    for moe in shard.moe_layers:  # as ModelShard does with rebalancing on
        moe.expert_load = torch.zeros(moe.moe.num_experts, dtype=torch.int64)
    monkeypatch.setattr(DecodeGraphs, "capture", _emulated_capture)
    shard._capture()  # (ModelShard runs it on CUDA only)
    shard.take_expert_load()
    prompts = random_prompts((5, 9, 13), seed=1)
    params = SamplingParams(max_tokens=2, min_tokens=2, temperature=0)
    llm.generate(prompts, params, use_tqdm=False)
    assert shard.decode_graphs.num_replays == 1  # the one decode step: 3 rows in bucket 4
    top_k = shard.moe_layers[0].top_k
    num_rows = sum(map(len, prompts)) + len(prompts)  # the prompts, then one decode each
    assert shard.take_expert_load().sum(dim=1).tolist() == [num_rows * top_k] * len(
        shard.moe_layers
    )
    assert llm.engine.leak_report() == []
