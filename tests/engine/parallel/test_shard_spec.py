"""How a model splits over tensor-parallel ranks, checked without starting any process:
each rank's shard, loaded by the real loader, is exactly its part of the full model."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from common.tensor_parallel import HeadSplit, split_problem
from deploy.cli import main
from engine.attention.registry import create_backend
from engine.models.arch import ModelLoadError, read_arch_config
from engine.models.loader import load_model
from engine.models.moe import SparseMoe
from engine.parallel.expert_placement import rank_slots
from engine.parallel.shard_spec import TensorParallel, check_split, local_arch, shard_spec


class RankAt:
    """Rank ``rank`` of ``size`` at load time: loading runs no collective."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        raise AssertionError("loading must not communicate")

    def min_int(self, value: int) -> int:
        raise AssertionError("loading must not communicate")

    def close(self) -> None:
        return None


def test_heads_split_and_kv_heads_replicate_when_fewer_than_ranks():
    # 8 query heads over 4 ranks with 2 KV heads: each KV head on two ranks.
    splits = [HeadSplit(8, 2, 4, rank) for rank in range(4)]
    assert [(s.q_head_start, s.q_heads) for s in splits] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [(s.kv_head_start, s.kv_heads) for s in splits] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    # Every rank's query heads use its own KV head (GQA group = 4 query heads).
    for split in splits:
        group = 8 // 2
        used = {h // group for h in range(split.q_head_start, split.q_head_start + 2)}
        assert used == {split.kv_head_start}
    # More KV heads than ranks: a share each.
    assert [(HeadSplit(8, 4, 2, r).kv_head_start, HeadSplit(8, 4, 2, r).kv_heads)
            for r in range(2)] == [(0, 2), (2, 2)]  # fmt: skip


@pytest.mark.parametrize(
    ("q", "kv", "widths", "tp", "problem"),
    [
        (8, 2, {"intermediate_size": 64}, 3, "8 attention heads do not split over 3 ranks"),
        (12, 6, {"intermediate_size": 64}, 4, "6 KV heads neither split over 4 ranks"),
        (8, 8, {"intermediate_size": 66}, 4, "intermediate_size=66 does not split"),
        (8, 8, {}, 0, "must be >= 1"),
    ],
)
def test_impossible_splits_are_refused_with_the_reason(q, kv, widths, tp, problem):
    assert problem in split_problem(q, kv, widths, tp)


def test_possible_splits_pass():
    assert split_problem(32, 8, {"intermediate_size": 14336}, 8) is None
    assert split_problem(28, 4, {"intermediate_size": 18944}, 4) is None  # Qwen2.5-7B
    assert split_problem(28, 4, {"intermediate_size": 18944}, 1) is None


def test_the_engine_refuses_a_model_that_does_not_split(tiny_llama):
    arch = read_arch_config(tiny_llama)  # 4 query heads
    with pytest.raises(ModelLoadError, match="engine.tensor_parallel_size=3: 4 attention"):
        check_split(arch, TensorParallel(3))


def test_expert_parallelism_needs_the_experts_to_divide(model_factory, tmp_path, capsys):
    """Whole experts per rank: their count must divide over the ranks (their width need
    not); refused by the engine and, before start, by ``pdserve config check``."""
    model_dir = model_factory("qwen3_moe")  # 8 experts, 4 query heads
    arch = read_arch_config(model_dir)
    six = dataclasses.replace(arch, moe=dataclasses.replace(arch.moe, num_experts=6))
    check_split(six, TensorParallel(2, 0, expert_parallel=True))
    with pytest.raises(ModelLoadError, match="6 routed experts do not divide over tensor_para"):
        check_split(six, TensorParallel(4, 0, expert_parallel=True))
    check_split(six, TensorParallel(4))  # by width: 6 experts of any count split
    wide = dataclasses.replace(arch, moe=dataclasses.replace(arch.moe, expert_intermediate_size=6))
    check_split(wide, TensorParallel(4, 0, expert_parallel=True))  # width 6: whole anyway
    with pytest.raises(ModelLoadError, match="moe_intermediate_size"):
        check_split(wide, TensorParallel(4))
    local = local_arch(arch, TensorParallel(4, 3, expert_parallel=True)).moe
    assert rank_slots(local.expert_placement, 3, 4) == (6, 7) and local.local_experts == 2
    assert local.expert_intermediate_size == arch.moe.expert_intermediate_size
    config = json.loads((model_dir / "config.json").read_text())
    copy = tmp_path / "six-experts"
    copy.mkdir()
    (copy / "config.json").write_text(json.dumps({**config, "num_local_experts": 6}))
    layout = tmp_path / "layout.yaml"
    layout.write_text("engine: {tensor_parallel_size: 4, expert_parallel: true}\n")
    assert main(["config", "check", str(layout), "--set", f"model={copy}"]) == 2
    assert "error: engine.expert_parallel: 6 routed experts" in capsys.readouterr().err
    # Redundant slots: experts and copies together must divide.
    layout.write_text("engine: {tensor_parallel_size: 2, expert_parallel: true, "
                      "num_redundant_experts: 1}\n")  # fmt: skip
    assert main(["config", "check", str(layout), "--set", f"model={model_dir}"]) == 2
    error = "error: engine.num_redundant_experts: 8 routed experts + 1 redundant do not divide"
    assert error in capsys.readouterr().err
    with pytest.raises(ModelLoadError, match="8 routed experts \\+ 1 redundant"):
        check_split(arch, TensorParallel(2, 0, expert_parallel=True, num_redundant_experts=1))


@pytest.mark.parametrize(
    ("arch_name", "tp_size"),
    [("llama", 2), ("llama", 4), ("qwen2_moe", 2), ("gpt_oss", 2), ("phi3", 2), ("gemma3", 2)],
)
def test_each_rank_loads_exactly_its_part_of_every_parameter(model_factory, arch_name, tp_size):
    model_dir = model_factory(arch_name)
    arch = read_arch_config(model_dir)
    backend = create_backend("torch", torch.device("cpu"), 16)
    cpu = torch.device("cpu")
    full = dict(load_model(model_dir, arch, 256, backend, cpu, torch.float32).named_parameters())
    shapes = []  # every rank holds as much as every other: no rank limits the KV cache
    for rank in range(tp_size):
        tp = TensorParallel(tp_size, rank)
        model = load_model(model_dir, arch, 256, backend, cpu, torch.float32, RankAt(rank, tp_size))
        assert model.arch == local_arch(arch, tp)
        shard = dict(model.named_parameters())
        assert set(shard) == set(full)
        shapes.append({name: part.shape for name, part in shard.items()})
        for name, part in shard.items():
            whole = full[name]
            spec = shard_spec(name, arch, tp)
            if spec is None:
                assert torch.equal(part, whole), name
                continue
            if spec.rank0_only:  # a bias after a row-parallel projection: added once
                assert torch.equal(part, whole if rank == 0 else torch.zeros_like(whole)), name
                continue
            axis = spec.dim + spec.per_expert
            covered = sum(piece.length for piece in spec.pieces)
            padding = part.narrow(axis, covered, part.shape[axis] - covered)
            assert not padding.any(), name  # the last vocabulary slice's padding: zeros
            if name not in ("model.embed_tokens.weight", "lm_head.weight"):
                assert padding.numel() == 0, name
            for piece in spec.pieces:
                expected = whole.narrow(axis, piece.full_start, piece.length)
                got = part.narrow(axis, piece.local_start, piece.length)
                assert torch.equal(got, expected), (name, rank, piece)
    assert all(ranks_shapes == shapes[0] for ranks_shapes in shapes)


@pytest.mark.parametrize(
    ("arch_name", "tp_size", "redundant"), [("gpt_oss", 2, 2), ("qwen3_moe", 4, 4)]
)
def test_each_rank_loads_the_experts_of_its_slots(model_factory, arch_name, tp_size, redundant):
    """Expert parallelism with redundant slots: every slot holds its expert's weights
    (GPT-OSS: and biases) whole, copies too; the routing tables name the rank's slots."""
    model_dir = model_factory(arch_name)
    arch = read_arch_config(model_dir)
    cpu, backend = torch.device("cpu"), create_backend("torch", torch.device("cpu"), 16)
    full = load_model(model_dir, arch, 256, backend, cpu, torch.float32)
    full_moes = [m for m in full.modules() if isinstance(m, SparseMoe)]
    held = []
    for rank in range(tp_size):
        tp = TensorParallel(tp_size, rank, expert_parallel=True, num_redundant_experts=redundant)
        model = load_model(model_dir, arch, 256, backend, cpu, torch.float32,
                           RankAt(rank, tp_size), tp=tp)  # fmt: skip
        moes = [m for m in model.modules() if isinstance(m, SparseMoe)]
        assert len(moes) == len(full_moes) > 0
        for moe, whole in zip(moes, full_moes, strict=True):
            slots = rank_slots(moe.expert_placement, rank, tp_size)
            assert len(slots) == (8 + redundant) // tp_size == moe.experts.gate_up_proj.shape[0]
            for name, param in moe.experts.named_parameters():
                for slot, expert in enumerate(slots):
                    assert torch.equal(param[slot], getattr(whole.experts, name)[expert]), name
            counts = moe.replica_counts.tolist()
            assert counts == [moe.expert_placement.count(e) for e in range(8)]
            for expert, replicas in enumerate(moe.replica_slots.tolist()):
                local = [r for r in replicas[: counts[expert]] if r < len(slots)]
                assert [slots[r] for r in local] == [expert] * len(local)
        held.append(slots)
    assert sorted(e for slots in held for e in slots) == sorted([*range(8), *range(redundant)])


def test_split_params_cover_the_full_parameter_once_over_the_ranks(model_factory):
    """Without KV replication, the ranks' pieces tile every split parameter exactly."""
    arch = read_arch_config(model_factory("qwen2_moe"))
    names = ["model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight",
             "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
             "model.layers.0.mlp.shared_expert.gate_up_proj.weight"]  # fmt: skip
    for name in names:
        covered = []
        for rank in range(2):
            spec = shard_spec(name, arch, TensorParallel(2, rank))
            for piece in spec.pieces:
                covered += range(piece.full_start, piece.full_start + piece.length)
        assert sorted(covered) == list(range(spec.full_size)), name
