"""Tensor-parallel prefill and decode workers as real processes (2 ranks each, gloo): the
disaggregated tokens equal one offline process's, every rank's KV moves through its own
connector, and a dead rank takes its worker out instead of hanging it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from engine import LLM, SamplingParams
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from tests.engine.helpers import random_prompts
from tests.support.pd_client import PDClient
from tests.support.processes import (
    WorkerProcess,
    is_running,
    kv_transfer_section,
    start_workers,
    write_config,
)
from tests.worker.test_services import assert_idle

GREEDY = pb.SamplingParams(max_tokens=12, min_tokens=12, temperature=0)
LENGTHS = (3, 16, 17, 40, 70, 129)


@pytest.fixture(scope="module")
def offline(tiny_llama) -> list[list[int]]:
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0)
    outputs = LLM(tiny_llama).generate(random_prompts(LENGTHS, seed=8), params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _stack(tmp, model, connector: str, **engine) -> list[WorkerProcess]:
    transfer = kv_transfer_section(connector, tmp / "shared")
    config = write_config(
        tmp / "config.yaml", model, kv_transfer=transfer,
        engine={"kv_cache_bytes": 32 << 20, "max_model_len": 512, "tensor_parallel_size": 2,
                **engine},
    )  # fmt: skip
    return start_workers(
        [
            WorkerProcess("prefill", 0, config, tmp / "prefill.log"),
            WorkerProcess("decode", 0, config, tmp / "decode.log"),
        ]
    )


def _shard_pids(worker: WorkerProcess) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(worker.proc.pid), "-f", "engine.parallel.shard_main"],
                         capture_output=True, text=True)  # fmt: skip
    return [int(pid) for pid in out.stdout.split()]


@pytest.mark.parametrize("connector", ["nixl", "shared_storage", "nccl"])
def test_disaggregated_tokens_equal_offline(tiny_llama, tmp_path, offline, connector):
    workers = _stack(tmp_path, tiny_llama, connector)
    prompts = random_prompts(LENGTHS, seed=8)

    async def body() -> None:
        client = PDClient(workers[0].address, workers[1].address)
        try:
            results = await asyncio.gather(
                *(client.generate(f"tp-{i}", p, GREEDY) for i, p in enumerate(prompts))
            )
            assert [r.token_ids for r in results] == offline
            await assert_idle(client)
            _, decode = await client.stats()
            # Every prompt's KV came from the prefill worker: nothing was recomputed.
            assert decode.blocks_pulled > 0 and decode.transfer_failures == 0
            # Each rank has its own handshake; a rank the worker lacks is a clear error.
            stub = pb_grpc.PrefillServiceStub(client.prefill_channel)
            ranks = [await stub.GetTransferMetadata(pb.TransferMetadataRequest(tp_rank=r))
                     for r in (0, 1)]  # fmt: skip
            assert ranks[0].metadata != ranks[1].metadata
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.GetTransferMetadata(pb.TransferMetadataRequest(tp_rank=2))
            assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        finally:
            await client.close()

    try:
        asyncio.run(body())
        assert [len(_shard_pids(w)) for w in workers] == [1, 1]
    finally:
        shards = [pid for w in workers for pid in _shard_pids(w)]
        codes = [worker.stop() for worker in workers]
    assert codes == [0, 0], "\n".join(w.log() for w in workers)
    assert not [pid for pid in shards if is_running(pid)], "shards outlived their workers"


def _assert_workers_give(
    workers: list[WorkerProcess],
    prompts: list[list[int]],
    expected: list[list[int]],
    check_decode_stats,
) -> None:
    """The workers' disaggregated tokens of ``prompts`` are ``expected``, they end idle,
    ``check_decode_stats(decode stats)`` holds, and both exit cleanly."""

    async def body() -> None:
        client = PDClient(workers[0].address, workers[1].address)
        try:
            results = await asyncio.gather(
                *(client.generate(f"r-{i}", p, GREEDY) for i, p in enumerate(prompts))
            )
            assert [r.token_ids for r in results] == expected
            await assert_idle(client)
            _, decode = await client.stats()
            check_decode_stats(decode)
        finally:
            await client.close()

    try:
        asyncio.run(body())
    finally:
        codes = [worker.stop() for worker in workers]
    assert codes == [0, 0], "\n".join(w.log() for w in workers)


def _offline(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0)
    with LLM(model_dir, dtype="float32") as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_rebalanced_expert_parallel_workers_equal_offline(model_factory, tmp_path):
    """Both roles deal a MoE model's experts out whole, with 2 redundant slots,
    rebalanced every 2 steps while they serve: the tokens of one offline process, and
    the decode worker reports its rebalancing in its stats."""
    model_dir = model_factory("qwen3_moe")
    prompts = random_prompts(LENGTHS[:4], seed=9)
    expected = _offline(model_dir, prompts)
    balanced = dict(expert_parallel=True, num_redundant_experts=2, expert_rebalance_interval=2)

    def rebalanced(decode: pb.StatsResponse) -> None:
        assert decode.expert_rebalances > 0 and decode.expert_moved_slots > 0
        assert decode.expert_imbalance >= 1.0

    workers = _stack(tmp_path, model_dir, "nixl", **balanced)
    _assert_workers_give(workers, prompts, expected, rebalanced)


def test_hybrid_model_workers_move_each_ranks_states(model_factory, tmp_path):
    """A hybrid model (Qwen3.5's layout) over 2 ranks in each role: every rank keeps its
    heads' linear-attention states in its own KV blocks, and its connector moves them
    with its KV: one offline process's tokens, nothing recomputed."""
    model_dir = model_factory("qwen3_5")
    prompts = random_prompts(LENGTHS[:4], seed=10)
    expected = _offline(model_dir, prompts)

    def pulled(decode: pb.StatsResponse) -> None:
        assert decode.blocks_pulled > 0 and decode.transfer_failures == 0

    _assert_workers_give(_stack(tmp_path, model_dir, "nixl"), prompts, expected, pulled)


def test_a_dead_rank_takes_its_worker_out_and_a_dead_worker_its_ranks(tiny_llama, tmp_path):
    workers = _stack(tmp_path, tiny_llama, "shared_storage")
    try:
        prefill, decode = workers
        (shard,) = _shard_pids(decode)
        os.kill(shard, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while decode.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert decode.proc.returncode == 1, decode.log()  # exits to be restarted
        assert "tensor-parallel rank 1" in decode.log()
        # A worker killed outright (no drain, no cleanup): its rank exits by itself.
        (shard,) = _shard_pids(prefill)
        prefill.proc.kill()
        prefill.proc.wait()
        deadline = time.monotonic() + 15
        while is_running(shard) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not is_running(shard), "the shard outlived its worker"
    finally:
        for worker in workers:
            worker.stop()


def test_a_rank_dead_before_the_worker_serves_takes_it_out(tiny_llama, tmp_path):
    """The rank dies while the worker still starts (here: as it warms up its grammars,
    after the engine is built): the worker must not stay SERVING with a dead rank."""
    config = write_config(
        tmp_path / "config.yaml", tiny_llama, kv_transfer={"connector": "nixl"},
        engine={"kv_cache_bytes": 32 << 20, "max_model_len": 512, "tensor_parallel_size": 2},
    )  # fmt: skip
    code = (
        "import os, signal, subprocess, sys, time\n"
        "import engine.grammar as grammar\n"
        "warm_up = grammar.Grammars.warm_up\n"
        "def kill_the_rank_first(self):\n"
        "    out = subprocess.run(['pgrep', '-P', str(os.getpid()), '-f', 'shard_main'],\n"
        "                         capture_output=True, text=True).stdout.split()\n"
        "    for pid in out: os.kill(int(pid), signal.SIGKILL)\n"
        "    time.sleep(1.0)\n"
        "    return warm_up(self)\n"
        "grammar.Grammars.warm_up = kill_the_rank_first\n"
        "from deploy.cli import main\n"
        f"sys.exit(main(['decode', '--config', {str(config)!r}, '--index', '0']))\n"
    )
    log = open(tmp_path / "decode.log", "wb")  # noqa: SIM115 (the child's)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT)
    try:
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, (tmp_path / "decode.log").read_text()[-3000:]
    assert "tensor-parallel rank 1 exited" in (tmp_path / "decode.log").read_text()
