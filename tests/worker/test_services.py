"""Prefill and decode workers as real processes, for each connector: same tokens as the
offline engine, prefix reuse, aborts, lease expiry and bad input."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import grpc
import pytest

from common.config import Role
from common.config_loader import load_config
from common.hashing import hash_blocks
from common.registry import StaticRegistry
from engine import LLM, SamplingParams
from engine.models.fp8_maker import quantize_checkpoint
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from router.dispatch import Dispatcher, SequenceRequest
from router.events import EventListener
from router.metrics import RouterMetrics
from router.policy import PlacementPolicy
from router.prefix_index import PrefixIndex
from router.workers import WorkerPool
from tests.engine.helpers import add_kv_scales, random_prompts
from tests.support.pd_client import PDClient
from tests.support.processes import WorkerProcess, kv_transfer_section, start_workers, write_config

CONNECTORS = ["nixl", "nccl", "shared_storage"]
GREEDY = pb.SamplingParams(max_tokens=16, min_tokens=16, temperature=0)
LENGTHS = (3, 9, 16, 17, 30, 33, 48, 50, 64, 65, 70, 90, 100, 128, 129, 150)


@pytest.fixture(scope="module")
def offline(tiny_llama) -> list[list[int]]:
    llm = LLM(tiny_llama)
    params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0)
    outputs = llm.generate(random_prompts(LENGTHS, seed=21), params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module", params=CONNECTORS)
def stack(request, tiny_llama, tmp_path_factory):
    connector = request.param
    tmp = tmp_path_factory.mktemp(f"stack-{connector}")
    transfer = kv_transfer_section(connector, tmp / "shared")
    config = write_config(tmp / "config.yaml", tiny_llama, kv_transfer=transfer)
    workers = start_workers(
        [
            WorkerProcess("prefill", 0, config, tmp / "prefill.log"),
            WorkerProcess("decode", 0, config, tmp / "decode.log"),
        ]
    )
    yield workers
    codes = [worker.stop() for worker in workers]
    assert codes == [0, 0], "\n".join(w.log() for w in workers)


def run(coro):
    return asyncio.run(coro)


async def with_client(stack, body):
    client = PDClient(stack[0].address, stack[1].address)
    try:
        return await body(client)
    finally:
        await client.close()


async def assert_idle(client: PDClient, timeout: float = 10.0) -> None:
    """Nothing held on either worker: no used blocks, no leases, no requests."""
    deadline = time.monotonic() + timeout
    while True:
        prefill, decode = await client.stats()
        idle = (
            prefill.kv_blocks_used == 0
            and decode.kv_blocks_used == 0
            and prefill.live_leases == 0
            and prefill.num_running + prefill.num_waiting == 0
            and decode.num_running + decode.num_waiting == 0
        )
        if idle or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert idle, f"still held:\nprefill {prefill}\ndecode {decode}"


def test_disaggregated_tokens_equal_offline(stack, offline):
    prompts = random_prompts(LENGTHS, seed=21)

    async def body(client: PDClient):
        _, before = await client.stats()
        results = await asyncio.gather(
            *(client.generate(f"parity-{i}", p, GREEDY) for i, p in enumerate(prompts))
        )
        for i, result in enumerate(results):
            assert result.token_ids == offline[i], f"prompt {i} ({len(prompts[i])} tokens)"
            assert result.finish_reason == "length"
            assert result.chunks[-1].usage.completion_tokens == 16
            # The pull's time and blocks come with the first reply (a sequence the router
            # ends early never sees the last).
            assert result.chunks[0].HasField("timings")
        await assert_idle(client)
        prefill, decode = await client.stats()
        assert decode.blocks_pulled > before.blocks_pulled
        pulled = sum(result.chunks[0].num_blocks_pulled for result in results)
        assert pulled == decode.blocks_pulled - before.blocks_pulled
        assert prefill.leases_released >= len(prompts)

    run(with_client(stack, body))


def test_decode_reuses_its_prefix_cache(stack):
    prefix = random_prompts((96,), seed=33)[0]

    async def body(client: PDClient):
        first = await client.generate("reuse-a", prefix + [5, 6, 7], GREEDY)
        _, before = await client.stats()
        second = await client.generate("reuse-b", prefix + [8, 9, 10, 11], GREEDY)
        _, after = await client.stats()
        # 100 tokens = 7 blocks; the first 6 (96 tokens) are cached on the decode worker.
        # (The first chunk says what was pulled.)
        assert first.chunks[0].num_blocks_pulled == 7
        assert second.chunks[0].num_blocks_pulled == 1
        assert after.blocks_pulled - before.blocks_pulled == 1
        assert after.blocks_reused_locally - before.blocks_reused_locally == 6
        assert second.prefill.num_cached_tokens == 96
        await assert_idle(client)

    run(with_client(stack, body))


def test_abort_and_client_cancel_leave_nothing(stack):
    long = pb.SamplingParams(max_tokens=400, min_tokens=400, temperature=0)
    prompt = random_prompts((40,), seed=44)[0]

    async def body(client: PDClient):
        # Client cancellation mid-stream.
        first = await client.prefill.Prefill(
            pb.PrefillRequest(request_id="cancel", token_ids=prompt, sampling=long), timeout=30
        )
        call = client.decode.Generate(
            pb.GenerateRequest(
                request_id="cancel",
                prompt_token_ids=prompt,
                output_token_ids=[first.first_token_id],
                sampling=long,
                kv=first.kv,
            )
        )
        received = 0
        async for chunk in call:
            received += len(chunk.token_ids)
            if received >= 3:
                break
        call.cancel()
        # Abort through the API mid-stream.
        first = await client.prefill.Prefill(
            pb.PrefillRequest(request_id="abort", token_ids=prompt, sampling=long), timeout=30
        )
        call = client.decode.Generate(
            pb.GenerateRequest(
                request_id="abort",
                prompt_token_ids=prompt,
                output_token_ids=[first.first_token_id],
                sampling=long,
                kv=first.kv,
            )
        )
        reasons = []
        async for chunk in call:
            if len(reasons) == 0 and chunk.token_ids:
                reply = await client.decode.Abort(pb.AbortRequest(request_id="abort"))
                assert reply.found
            reasons.append(chunk.finish_reason)
        assert reasons[-1] == "abort" and len(reasons) < 400
        await assert_idle(client)

    run(with_client(stack, body))


def test_unpulled_lease_expires(stack, request):
    connector = request.node.callspec.params["stack"]
    lease_s = load_config(str(stack[0].config_path)).kv_transfer.lease_s

    async def body(client: PDClient):
        before, _ = await client.stats()
        asked_at = time.monotonic()
        reply = await client.prefill.Prefill(
            pb.PrefillRequest(
                request_id="orphan", token_ids=random_prompts((50,), seed=55)[0], sampling=GREEDY
            ),
            timeout=30,
        )
        assert reply.kv.lease_id and len(reply.kv.block_ids) == 4
        held, _ = await client.stats()
        if connector == "shared_storage":
            # The export ends once the blocks are in the shared directory, which may
            # already have happened: the lease is live or released, never both or neither.
            released = held.leases_released - before.leases_released
            assert held.live_leases + released == 1
        else:
            assert held.live_leases == 1 and held.kv_blocks_used == 4
        # The blocks written to the shared directory end the export at once; elsewhere
        # the lease runs out, not before lease_s.
        ended = "leases_released" if connector == "shared_storage" else "leases_expired"
        deadline = time.monotonic() + lease_s + 15
        while getattr(after := (await client.stats())[0], ended) == getattr(before, ended):
            assert time.monotonic() < deadline, f"the lease never ended: {after}"
            await asyncio.sleep(0.05)
        assert getattr(after, ended) == getattr(before, ended) + 1
        if connector != "shared_storage":
            assert time.monotonic() - asked_at >= lease_s
            assert after.leases_released == before.leases_released
        await assert_idle(client)

    run(with_client(stack, body))


def test_bad_requests_are_invalid_argument_and_the_worker_keeps_serving(stack, offline):
    prompt = random_prompts(LENGTHS, seed=21)[0]

    async def body(client: PDClient):
        bad = [
            pb.PrefillRequest(request_id="e1", token_ids=[], sampling=GREEDY),
            pb.PrefillRequest(request_id="e2", token_ids=[5] * 1025, sampling=GREEDY),
            pb.PrefillRequest(
                request_id="e3", token_ids=prompt, sampling=pb.SamplingParams(temperature=-1)
            ),
            pb.PrefillRequest(request_id="e4", token_ids=[10**6], sampling=GREEDY),
        ]
        for request in bad:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.prefill.Prefill(request, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        first = await client.prefill.Prefill(
            pb.PrefillRequest(request_id="ok", token_ids=prompt, sampling=GREEDY), timeout=10
        )
        wrong = pb.KVHandle()
        wrong.CopyFrom(first.kv)
        wrong.block_size = 32
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in client.decode.Generate(
                pb.GenerateRequest(
                    request_id="ok", prompt_token_ids=prompt, sampling=GREEDY, kv=wrong
                ),
                timeout=10,
            ):
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "block_size" in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.prefill.ReleaseKV(pb.ReleaseKVRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        await client.prefill.ReleaseKV(pb.ReleaseKVRequest(lease_id=first.kv.lease_id))
        result = await client.generate("after-errors", prompt, GREEDY)
        assert result.token_ids == offline[0]
        await assert_idle(client)

    run(with_client(stack, body))


@pytest.mark.parametrize("field", ["tp_size", "connector", "model_namespace"])
def test_a_handle_from_a_prefill_worker_of_another_tp_size_is_computed_at_once(
    stack, offline, field
):
    """Each rank moves its own heads, so a decode worker of another tensor_parallel_size
    cannot use the blocks: NIXL failed the handshake, shared storage waited out its
    timeout for files under another layout, for every prompt. The handle says the size
    now, and the decode worker computes the prompt at once. So too a handle of another
    connector (it was a 400 to the client, and the lease pinned until it expired), or of
    other weights (another checkpoint, or linear_state_dtype: the KV is another model's)."""
    prompt = random_prompts(LENGTHS, seed=21)[0]

    async def body(client: PDClient):
        first = await client.prefill.Prefill(
            pb.PrefillRequest(request_id="tp", token_ids=prompt, sampling=GREEDY), timeout=10
        )
        assert first.kv.tp_size == 1
        other = pb.KVHandle()
        other.CopyFrom(first.kv)
        if field == "tp_size":
            other.tp_size = 2
        elif field == "connector":
            other.connector = "nccl" if first.kv.connector != "nccl" else "nixl"
        else:
            assert first.kv.model_namespace  # the prefill worker says it
            other.model_namespace = first.kv.model_namespace + "-other"
        request = pb.GenerateRequest(request_id="tp", prompt_token_ids=prompt, sampling=GREEDY,
                                     output_token_ids=[first.first_token_id], kv=other)  # fmt: skip
        _, before = await client.stats()
        start = time.monotonic()
        tokens = [first.first_token_id]
        async for chunk in client.decode.Generate(request, timeout=30):
            tokens.extend(chunk.token_ids)
        assert tokens == offline[0] and time.monotonic() - start < 2.0
        _, after = await client.stats()
        assert after.blocks_pulled == before.blocks_pulled
        await client.prefill.ReleaseKV(pb.ReleaseKVRequest(lease_id=first.kv.lease_id))
        await assert_idle(client)

    run(with_client(stack, body))


def test_a_handle_to_another_prompts_blocks_is_computed_here_and_caches_nothing(stack, offline):
    """A handle whose block names are not the prompt's (a router's bug, a script): the
    blocks were pulled and cached under this prompt's names, so the request got the other
    prompt's continuation and every later request sharing the prefix on this worker too.
    The prompt is computed here instead, and a later request for it is right."""
    prompt = random_prompts(LENGTHS, seed=21)[6]  # 48 tokens: 3 full blocks
    other = [(t * 7 + 3) % 1000 + 5 for t in prompt]

    async def body(client: PDClient):
        leased = await client.prefill.Prefill(
            pb.PrefillRequest(request_id="other", token_ids=other, sampling=GREEDY), timeout=10
        )
        request = pb.GenerateRequest(request_id="mixed", prompt_token_ids=prompt,
                                     output_token_ids=[offline[6][0]], sampling=GREEDY,
                                     kv=leased.kv)  # fmt: skip
        _, before = await client.stats()
        tokens = [offline[6][0]]
        async for chunk in client.decode.Generate(request, timeout=30):
            tokens.extend(chunk.token_ids)
        assert tokens == offline[6]
        _, after = await client.stats()
        assert after.blocks_pulled == before.blocks_pulled
        await client.prefill.ReleaseKV(pb.ReleaseKVRequest(lease_id=leased.kv.lease_id))
        again = await client.generate("again", prompt, GREEDY)  # its prefix: not the other's
        assert again.token_ids == offline[6]
        await assert_idle(client)

    run(with_client(stack, body))


def test_a_client_gone_while_the_prefill_reply_is_in_flight_leaves_no_lease(stack):
    """The router's task is cancelled after the worker granted the lease but before the
    reply was read (a busy router loop): the router releases by request id, and withdraws
    the prefix claims its placement made."""
    config = load_config(str(stack[0].config_path))
    router_config = dataclasses.replace(config.router, min_disagg_tokens=0)
    prompt = random_prompts((50,), seed=56)[0]

    async def body(client: PDClient):
        lock = threading.Lock()
        index = PrefixIndex()
        pool = WorkerPool(StaticRegistry(config), EventListener(index, lock), 60.0, 30.0)
        policy = PlacementPolicy(router_config, 16, 8)
        dispatcher = Dispatcher(router_config, pool, index, lock, policy,
                                RouterMetrics("lease_race"), 16)  # fmt: skip
        try:
            await pool.refresh()
            before, _ = await client.stats()
            ids = [pool.candidates(role)[0].worker_id for role in Role]
            hashes = hash_blocks(prompt, 16)
            request = SequenceRequest("gone", prompt, hashes, GREEDY)
            task = asyncio.create_task(anext(dispatcher.generate(request)))
            for _ in range(20):
                await asyncio.sleep(0)  # the call goes out
            # Block this loop until the worker has granted the lease: its reply is in
            # flight and nobody here has read it.
            with grpc.insecure_channel(stack[0].address) as channel:
                stats = pb_grpc.PrefillServiceStub(channel).Stats
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:
                    now = stats(pb.StatsRequest(), timeout=5)
                    if now.live_leases + now.leases_released > before.leases_released:
                        break
                    time.sleep(0.01)
                else:  # the race this test is about never happened
                    pytest.fail("the prefill worker granted no lease within 20 s")
            assert not task.done()
            assert all(m.gpu_blocks == 3 for m in index.match(hashes, ids).values())
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert all(m.gpu_blocks == 0 for m in index.match(hashes, ids).values())
            await assert_idle(client, timeout=3.0)  # before the lease's 4 s expiry
            after, _ = await client.stats()
            assert after.leases_expired == before.leases_expired
        finally:
            await pool.close()

    run(with_client(stack, body))


@pytest.mark.parametrize("stack", ["nixl"], indirect=True)  # no KV moves: one is enough
def test_a_decode_stream_the_router_falls_behind_on_comes_merged(stack):
    """On the router's channel to a decode worker (``DECODE_CHANNEL_OPTIONS``) a stream
    nobody reads stops the worker's writes after a few messages; the engine goes on, and
    what it makes meanwhile comes as one message when the reading resumes
    (``AsyncEngine``'s merge). With gRPC's default window the worker would have sent all
    200 tokens one by one. Tokens and finish are those of a stream read as it goes."""
    config = load_config(str(stack[0].config_path))
    prompt = random_prompts((20,), seed=61)[0]
    sampling = pb.SamplingParams(max_tokens=200, min_tokens=200, temperature=0)

    async def body(client: PDClient):
        request = pb.GenerateRequest(request_id="read", prompt_token_ids=prompt,
                                     sampling=sampling)  # fmt: skip
        read = [chunk async for chunk in client.decode.Generate(request, timeout=60)]
        pool = WorkerPool(StaticRegistry(config), EventListener(PrefixIndex(), threading.Lock()),
                          60.0, 30.0)  # fmt: skip
        try:
            await pool.refresh()
            (decode,) = pool.candidates(Role.DECODE)
            request.request_id = "unread"
            call = decode.decode.Generate(request, timeout=60)
            chunks = [await call.read()]  # it runs
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the engine finishes; nobody reads
                _, now = await client.stats()
                if now.num_running + now.num_waiting == 0:
                    break
                await asyncio.sleep(0.05)
            while (chunk := await call.read()) is not grpc.aio.EOF:
                chunks.append(chunk)
        finally:
            await pool.close()
        tokens = [t for chunk in chunks for t in chunk.token_ids]
        assert tokens == [t for chunk in read for t in chunk.token_ids]
        assert chunks[-1].finish_reason == read[-1].finish_reason == "length"
        # Read as it went: about a message per step (fewer when a loaded box lets the
        # engine run ahead of the server's loop, which merges them too).
        assert len(read) >= 100
        assert len(chunks) < 60 and max(len(chunk.token_ids) for chunk in chunks) > 100
        await assert_idle(client)

    run(with_client(stack, body))


def fp8_cache_pair_serves_as_offline(model_dir, tmp_path, prompts) -> str:
    """Prefill + decode workers over NIXL with ``engine.kv_cache_dtype: fp8`` give the
    offline engine's tokens (same files, same cache), and the decode worker pulled the
    prompts' full blocks; returns the decode worker's log."""
    llm = LLM(model_dir, kv_cache_dtype="fp8")
    params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    config = write_config(
        tmp_path / "config.yaml", model_dir, engine={"kv_cache_dtype": "fp8"},
        kv_transfer={"connector": "nixl"},
    )  # fmt: skip
    workers = start_workers(
        [
            WorkerProcess("prefill", 0, config, tmp_path / "prefill.log"),
            WorkerProcess("decode", 0, config, tmp_path / "decode.log"),
        ]
    )

    async def body(client: PDClient):
        results = await asyncio.gather(
            *(client.generate(f"fp8-{i}", p, GREEDY) for i, p in enumerate(prompts))
        )
        assert [result.token_ids for result in results] == expected
        await assert_idle(client)
        _, decode = await client.stats()
        assert decode.blocks_pulled >= sum(len(p) // 16 for p in prompts)

    try:
        run(with_client(workers, body))
    finally:
        codes = [worker.stop() for worker in workers]
    assert codes == [0, 0], "\n".join(w.log() for w in workers)
    return workers[1].log()


def test_fp8_weights_and_an_fp8_kv_cache_move_and_decode_as_offline(tiny_llama, tmp_path):
    """An FP8 checkpoint (Qwen3-FP8's block-scaled layout, calibrated K/V scales) with
    ``engine.kv_cache_dtype: fp8`` on both roles: the handshake agrees on the FP8 layout,
    the blocks (K/V over the scales) move over NIXL, and the tokens are the offline
    engine's on the same files with the same cache."""
    model_dir = quantize_checkpoint(tiny_llama, tmp_path / "fp8-model", "fp8-block")
    add_kv_scales(model_dir, {0: (0.0137, 0.0291), 1: (0.0213, 0.0117), 3: (0.0079, 0.0173)})
    log = fp8_cache_pair_serves_as_offline(
        model_dir, tmp_path, random_prompts((9, 40, 70), seed=23)
    )
    assert "float8_e4m3fn" in log  # the decode worker's cache line


def test_deepseek_latents_move_and_decode_as_offline(model_factory, tmp_path):
    """DeepSeek-V3 in its release format (block-scaled FP8 weights) with an FP8 cache: each
    token's latent (one KV head of half of it in each of the K and V slots) moves over
    NIXL as any model's K/V, and the tokens are the offline engine's."""
    model_dir = quantize_checkpoint(model_factory("deepseek_v3"), tmp_path / "fp8", "fp8-block",
                                    (32, 64))  # fmt: skip
    log = fp8_cache_pair_serves_as_offline(
        model_dir, tmp_path, random_prompts((9, 40, 70), seed=29)
    )
    assert "attention backend torch" in log
