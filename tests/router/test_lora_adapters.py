"""The router's LoRA adapter table: which files a request of an adapter runs with and on
which workers, and runtime loads that are all or nothing across workers, with workers
over real gRPC that refuse or read other files (failures two real workers on one machine
cannot produce); ``reconcile`` bringing a worker that missed a load or an unload back to
the intents (one router's, in process: tests/router/test_lora_shared.py shares them)."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from common.config import LoraSettings, Role
from common.lora_intents import LocalLoraIntents, LoraIntent, LoraIntentState
from common.registry import WorkerInfo
from proto import PARAM_KEY
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from router.errors import APIError
from router.lora_adapters import LoraAdapters
from router.workers import LoraRef, WorkerPool, WorkerState

ENABLED = LoraSettings(adapters={"bob": "/adapters/bob"}, runtime_loading=True)


class AdapterWorker(pb_grpc.PrefillServiceServicer):
    """Loads whatever it is asked to as ``fingerprint``'s files; refuses every load (as a
    worker that cannot read the path) when that is None."""

    def __init__(self, fingerprint: str | None, adapters: dict[str, str] | None = None) -> None:
        self.fingerprint = fingerprint
        self.adapters = dict(adapters or {})
        self.calls: list[tuple[str, str]] = []

    async def LoadLoraAdapter(self, request, context):
        self.calls.append(("load", request.name))
        if self.fingerprint is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no adapter_config.json",
                                trailing_metadata=((PARAM_KEY, "lora_path"),))  # fmt: skip
        already = self.adapters.get(request.name) == self.fingerprint
        self.adapters[request.name] = self.fingerprint
        info = pb.LoraAdapterInfo(name=request.name, fingerprint=self.fingerprint)
        return pb.LoadLoraAdapterResponse(adapter=info, already_loaded=already)

    async def UnloadLoraAdapter(self, request, context):
        self.calls.append(("unload", request.name))
        return pb.UnloadLoraAdapterResponse(unloaded=bool(self.adapters.pop(request.name, None)))


class FrozenAdapterWorker(AdapterWorker):
    """Answers nothing about adapters: a worker frozen (a stopped process) after it
    answered its last probe."""

    async def LoadLoraAdapter(self, request, context):
        self.calls.append(("load", request.name))
        await asyncio.Event().wait()


def adapters_of(states: list[WorkerState], settings: LoraSettings = ENABLED) -> LoraAdapters:
    return LoraAdapters(settings, pool_of(states), "base", LocalLoraIntents(), 0.0)


def intend(adapters: LoraAdapters, name: str, state: str = "loaded", fingerprint: str = "f1"):
    """Write ``name``'s intent as a load or unload through another router would."""
    adapters.store.set_lora_intent(LoraIntent(name=name, path=f"/adapters/{name}",
                                              fingerprint=fingerprint,
                                              state=LoraIntentState(state)))  # fmt: skip


def pool_of(states: list[WorkerState]) -> WorkerPool:
    pool = WorkerPool(registry=None, events=None, refresh_s=1.0, request_timeout_s=5.0)
    pool.workers = {state.worker_id: state for state in states}
    return pool


def info(worker_id: str, role: Role = Role.PREFILL, address: str = "127.0.0.1:1") -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, grpc_address=address,
                      events_endpoint="tcp://127.0.0.1:2",
                      replay_endpoint="tcp://127.0.0.1:3")  # fmt: skip


def offline_state(worker_id: str, role: Role, adapters: dict[str, str]) -> WorkerState:
    """A worker as the pool last saw it, with no connection (placement only)."""
    return WorkerState(info(worker_id, role), None, None, None, None, healthy=True,
                       lora_adapters=dict(adapters))  # fmt: skip


async def serve(workers: list[AdapterWorker]) -> tuple[list[grpc.aio.Server], list[WorkerState]]:
    servers, states = [], []
    for i, worker in enumerate(workers):
        server = grpc.aio.server()
        pb_grpc.add_PrefillServiceServicer_to_server(worker, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        state = WorkerState(info(f"prefill-{i}", address=f"127.0.0.1:{port}"), channel,
                            pb_grpc.PrefillServiceStub(channel), None, None, healthy=True,
                            lora_adapters=dict(worker.adapters))  # fmt: skip
        servers.append(server)
        states.append(state)
    return servers, states


def run_with(workers: list[AdapterWorker], scenario, settings: LoraSettings = ENABLED):
    """``scenario(adapters, states)`` against ``workers`` served on 127.0.0.1."""

    async def main():
        servers, states = await serve(workers)
        try:
            return await scenario(adapters_of(states, settings), states)
        finally:
            for state in states:
                await state.channel.close()
            for server in servers:
                await server.stop(None)

    return asyncio.run(main())


def test_a_load_one_worker_refuses_is_undone_on_the_others():
    good, bad = AdapterWorker("f1"), AdapterWorker(None)

    async def scenario(adapters: LoraAdapters, states):
        with pytest.raises(APIError) as refused:
            await adapters.load("alice", "/adapters/alice")
        return refused.value

    error = run_with([good, bad], scenario)
    assert (error.status, error.param) == (400, "lora_path")
    assert "prefill-1: no adapter_config.json" in error.message
    assert good.calls == [("load", "alice"), ("unload", "alice")]
    assert good.adapters == {} and bad.adapters == {}


def test_workers_that_read_other_files_at_the_path_undo_the_load():
    one, other = AdapterWorker("f1"), AdapterWorker("f2")

    async def scenario(adapters: LoraAdapters, states):
        with pytest.raises(APIError) as refused:
            await adapters.load("alice", "/adapters/alice")
        return refused.value, adapters.store.lora_intents(), [s.lora_adapters for s in states]

    error, intents, seen = run_with([one, other], scenario)
    assert (error.status, error.param) == (400, "lora_path")
    assert "different files" in error.message
    assert one.adapters == {} and other.adapters == {} and intents == {}
    assert seen == [{}, {}]


def test_an_undone_load_keeps_it_where_it_was_loaded_before():
    had_it, bad = AdapterWorker("f1", {"alice": "f1"}), AdapterWorker(None)

    async def scenario(adapters: LoraAdapters, states):
        with pytest.raises(APIError):
            await adapters.load("alice", "/adapters/alice")

    run_with([had_it, bad], scenario)
    assert had_it.adapters == {"alice": "f1"}
    assert ("unload", "alice") not in had_it.calls


class LoadsThenFails(AdapterWorker):
    """Loads the adapter, then the call fails as a lost answer does (UNAVAILABLE)."""

    async def LoadLoraAdapter(self, request, context):
        await super().LoadLoraAdapter(request, context)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")


def test_a_load_whose_answer_was_lost_is_undone_there_too():
    """A worker that loaded the adapter but whose answer never came (a deadline passed as
    it finished) kept it, serving a name the client was told nothing was loaded under;
    one that served the name before keeps it."""
    good, lost, had_it = AdapterWorker("f1"), LoadsThenFails("f1"), LoadsThenFails("f1")
    had_it.adapters["alice"] = "f1"

    async def scenario(adapters: LoraAdapters, states):
        with pytest.raises(APIError) as refused:
            await adapters.load("alice", "/adapters/alice")
        return refused.value

    error = run_with([good, lost, had_it], scenario)
    assert error.status == 503 and "nothing was loaded" in error.message
    assert good.adapters == {} and lost.adapters == {}
    assert lost.calls == [("load", "alice"), ("unload", "alice")]
    assert had_it.adapters == {"alice": "f1"} and ("unload", "alice") not in had_it.calls


def test_a_load_and_an_unload_reach_every_worker_and_the_placement():
    workers = [AdapterWorker("f1"), AdapterWorker("f1")]

    async def scenario(adapters: LoraAdapters, states):
        reply = await adapters.load("alice", "/adapters/alice")
        placed = adapters.pool.candidates(Role.PREFILL, adapters.resolve("alice"))
        after_load = (reply, len(placed), adapters.names())
        await adapters.unload("alice")
        with pytest.raises(APIError) as gone:
            await adapters.unload("alice")
        placed = adapters.pool.candidates(Role.PREFILL, LoraRef("alice", "f1"))
        return after_load, (len(placed), adapters.names(), gone.value.status)

    (reply, num_placed, names), after_unload = run_with(workers, scenario)
    assert reply == {"object": "lora_adapter", "id": "alice", "fingerprint": "f1",
                     "num_workers": 2}  # fmt: skip
    assert num_placed == 2 and names == ["alice", "bob"]
    assert after_unload == (0, ["bob"], 404)
    assert all(w.adapters == {} for w in workers)


def test_an_unload_waits_for_the_adapters_requests_in_flight_here():
    worker = AdapterWorker("f1")

    async def scenario(adapters: LoraAdapters, states):
        await adapters.load("alice", "/adapters/alice")
        release = adapters.admit("alice", 2)  # two sequences between prefill and decode
        unload = asyncio.create_task(adapters.unload("alice"))
        await asyncio.sleep(0.3)
        during = (unload.done(), adapters.names(), dict(worker.adapters))
        with pytest.raises(APIError) as refused:
            adapters.resolve("alice")  # a request that passed the model check before
        with pytest.raises(APIError) as reload:
            await adapters.load("alice", "/adapters/alice")
        release()
        await unload
        return during, refused.value.status, reload.value.status, dict(worker.adapters)

    during, refused, reload, after = run_with([worker], scenario)
    assert during == (False, ["bob"], {"alice": "f1"})  # refused to new requests only
    assert (refused, reload, after) == (404, 400, {})


def test_a_load_queued_behind_an_unload_is_refused_not_undone():
    """The lock held (a reconcile), an unload and then a load of the same name queue on
    it: the unload takes it first. The load, answered 200, was undone on every worker
    and the router kept the name both loaded and unloaded (loaded and unloaded again at
    every reconcile). Now the load is refused, and the router agrees with the workers."""
    worker = AdapterWorker("f1")

    async def scenario(adapters: LoraAdapters, states):
        await adapters.load("alice", "/adapters/alice")
        await adapters._lock.acquire()  # a reconcile holds the lock
        unload = asyncio.create_task(adapters.unload("alice"))
        await asyncio.sleep(0.01)
        load = asyncio.create_task(adapters.load("alice", "/adapters/alice"))
        await asyncio.sleep(0.01)
        adapters._lock.release()
        await unload
        with pytest.raises(APIError) as refused:
            await load
        worker.calls.clear()
        await adapters.reconcile()
        state = adapters.store.lora_intents()["alice"].state
        return refused.value.status, state, dict(worker.adapters), worker.calls

    assert run_with([worker], scenario) == (400, LoraIntentState.UNLOADED, {}, [])


def test_an_unload_goes_ahead_after_the_grace():
    worker = AdapterWorker("f1")
    settings = LoraSettings(runtime_loading=True, unload_grace_s=0.2)

    async def scenario(adapters: LoraAdapters, states):
        await adapters.load("alice", "/adapters/alice")
        adapters.admit("alice", 1)  # never released
        await asyncio.wait_for(adapters.unload("alice"), 5.0)
        return dict(worker.adapters), adapters.intents["alice"].state

    assert run_with([worker], scenario, settings) == ({}, LoraIntentState.UNLOADED)


def test_reconcile_loads_what_a_worker_lacks_and_unloads_what_it_missed():
    restarted, stale = AdapterWorker("f1"), AdapterWorker("f1", {"old": "f1", "alice": "f1"})

    async def scenario(adapters: LoraAdapters, states):
        await adapters.load("alice", "/adapters/alice")  # both: alice
        restarted.adapters.clear()  # it restarted: runtime loads are gone
        states[0].lora_adapters = {}  # as its next Stats says
        intend(adapters, "old", "unloaded")  # unloaded while the second was unreachable
        await adapters.reconcile()
        return [dict(s.lora_adapters) for s in states]

    seen = run_with([restarted, stale], scenario)
    assert restarted.adapters == {"alice": "f1"} and stale.adapters == {"alice": "f1"}
    assert seen == [{"alice": "f1"}, {"alice": "f1"}]


def test_reconcile_is_not_held_back_by_a_frozen_worker():
    """Both workers restarted since alice was loaded; the first froze. The other gets
    alice at once (one by one, it waited for the frozen call: up to LOAD_TIMEOUT_S), and
    the pool's stall give-up ends the frozen call, as any call to that worker."""
    frozen, healthy = FrozenAdapterWorker("f1"), AdapterWorker("f1")

    async def scenario(adapters: LoraAdapters, states):
        intend(adapters, "alice")
        reconcile = asyncio.create_task(adapters.reconcile())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        # (Both calls go out at once: on a loaded box the healthy one may finish before
        # the frozen one has even arrived, so wait for that too.)
        while "alice" not in healthy.adapters or not frozen.calls:
            assert loop.time() < deadline, "the healthy worker never got alice"
            await asyncio.sleep(0.01)
        assert frozen.calls == [("load", "alice")] and not reconcile.done()
        state = states[0]  # as the pool finds it: silent past the stall timeout
        state.answered_at -= adapters.pool.stall_timeout_s + 1
        state.missed_probes = 1
        adapters.pool._give_up_if_stalled(state)
        await asyncio.wait_for(reconcile, 10)
        return [dict(s.lora_adapters) for s in states]

    assert run_with([frozen, healthy], scenario) == [{}, {"alice": "f1"}]


def test_reconcile_does_not_serve_files_that_changed_on_disk():
    changed = AdapterWorker("f2")

    async def scenario(adapters: LoraAdapters, states):
        intend(adapters, "alice")  # loaded as f1 before
        await adapters.reconcile()
        await adapters.reconcile()  # found changed once: not read again every refresh
        return states[0].lora_adapters

    seen = run_with([changed], scenario)
    assert seen == {} and changed.adapters == {}
    assert changed.calls == [("load", "alice"), ("unload", "alice")]


def test_a_catch_up_the_worker_refuses_is_said_once_and_not_retried(caplog):
    """The adapter's files gone (a restarted worker cannot read them): the reconcile asked
    again and logged a WARNING at every refresh, a line a second for ever. Refused, it is
    said once, with what to do, and not retried until the adapter is loaded again."""
    refusing = AdapterWorker(None)

    async def scenario(adapters: LoraAdapters, states):
        intend(adapters, "alice")
        with caplog.at_level(logging.WARNING, logger="router.lora_reconcile"):
            for _ in range(3):
                await adapters.reconcile()
        return states[0].lora_adapters

    assert run_with([refusing], scenario) == {}
    assert refusing.calls == [("load", "alice")]
    (line,) = [r for r in caplog.records if r.name == "router.lora_reconcile"]
    assert line.levelno == logging.ERROR and "restore its files" in line.getMessage()


class LimitedWorker(AdapterWorker):
    """Refuses a load past ``max_adapters`` as the engine does (a passing cause: an
    unload frees the slot; the refusal names lora_name, not the files)."""

    max_adapters = 1

    async def LoadLoraAdapter(self, request, context):
        if request.name not in self.adapters and len(self.adapters) >= self.max_adapters:
            self.calls.append(("load", request.name))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the most allowed",
                                trailing_metadata=((PARAM_KEY, "lora_name"),))  # fmt: skip
        return await super().LoadLoraAdapter(request, context)


def test_a_catch_up_the_workers_limit_refuses_is_retried_after_the_stale_unload():
    """A worker that missed an unload (unreachable then) held the stale adapter in its
    one slot; the load it also missed was refused for the limit, taken for its files and
    never retried. Stale adapters go first, and a limit's refusal is retried."""
    worker = LimitedWorker("f1", adapters={"x": "fx"})

    async def scenario(adapters: LoraAdapters, states):
        intend(adapters, "alice")
        intend(adapters, "x", "unloaded", "fx")
        await adapters.reconcile()
        return states[0].lora_adapters

    assert run_with([worker], scenario) == {"alice": "f1"}
    assert worker.calls == [("unload", "x"), ("load", "alice")]


def test_a_catch_up_the_limit_refuses_is_retried_and_said_once(caplog):
    """The worker's one slot held by an adapter this router knows nothing of: the load is
    refused for the limit at every refresh (said once), and made once the slot frees
    (another router unloaded it). Taken for refused files, it was never retried."""
    worker = LimitedWorker("f1", adapters={"other": "fo"})

    async def scenario(adapters: LoraAdapters, states):
        intend(adapters, "alice")
        with caplog.at_level(logging.WARNING, logger="router.lora_reconcile"):
            await adapters.reconcile()
            await adapters.reconcile()
            worker.adapters.pop("other")
            states[0].set_lora_adapters({})  # (as its next Stats says)
            await adapters.reconcile()
        return states[0].lora_adapters

    assert run_with([worker], scenario) == {"alice": "f1"}
    assert [c for c in worker.calls if c[0] == "load"] == [("load", "alice")] * 3
    said = [r for r in caplog.records if r.name == "router.lora_reconcile"]
    assert len(said) == 1 and said[0].levelno == logging.WARNING


def test_requests_run_with_the_files_most_workers_serve():
    states = [
        offline_state("p0", Role.PREFILL, {"alice": "f1"}),
        offline_state("d0", Role.DECODE, {"alice": "f1"}),
        offline_state("d1", Role.DECODE, {"alice": "f2"}),
        offline_state("d2", Role.DECODE, {}),
    ]
    adapters = adapters_of(states)
    assert adapters.resolve("alice") == LoraRef("alice", "f1")
    assert [w.worker_id for w in adapters.pool.candidates(Role.DECODE, LoraRef("alice", "f1"))] == [
        "d0"
    ]
    assert len(adapters.pool.candidates(Role.DECODE)) == 3  # the base model: every one
    states[0].healthy = False  # now one each: the tie goes to the smaller fingerprint
    assert adapters.resolve("alice").fingerprint == "f1"
    states[1].healthy = False
    assert adapters.resolve("alice").fingerprint == "f2"
    with pytest.raises(APIError) as none:
        adapters.resolve("carol")
    assert none.value.status == 503
    assert adapters.names() == ["alice", "bob"]


def test_refusals_before_any_worker_is_asked():
    adapters = adapters_of([])
    off = adapters_of([], LoraSettings())

    async def refusal(call) -> tuple[int, str | None]:
        with pytest.raises(APIError) as error:
            await call
        return error.value.status, error.value.param

    async def main():
        return [
            await refusal(off.load("alice", "/a")),
            await refusal(off.unload("alice")),
            await refusal(adapters.load("no spaces", "/a")),
            await refusal(adapters.load("base", "/a")),
            await refusal(adapters.load("alice", "")),
            await refusal(adapters.unload("bob")),  # configured: the config decides
            await refusal(adapters.load("alice", "/a")),  # valid, but no worker is up
        ]

    assert asyncio.run(main()) == [
        (404, None), (404, None), (400, "lora_name"), (400, "lora_name"), (400, "lora_path"),
        (400, "lora_name"), (503, None),
    ]  # fmt: skip
