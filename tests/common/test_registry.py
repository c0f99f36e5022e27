"""Worker registry: static from the config, and Redis with TTL (a real redis-server)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from common.config import Role
from common.config_loader import load_config
from common.lora_intents import LoraIntent, LoraIntentState
from common.registry import (
    RedisRegistry,
    Registry,
    RegistryError,
    StaticRegistry,
    WorkerInfo,
    create_registry,
)
from tests.common.redis_server import free_port, redis_server


def info(name: str, role: Role = Role.PREFILL) -> WorkerInfo:
    return WorkerInfo(
        worker_id=name,
        role=role,
        grpc_address="127.0.0.1:1",
        events_endpoint="tcp://127.0.0.1:2",
        replay_endpoint="tcp://127.0.0.1:3",
        engine_id="e-1",
        kv_blocks_total=100,
        block_size=16,
        draining=False,
    )


def test_static_registry_lists_the_configured_layout():
    config = load_config(None, ["prefill.replicas=2", "decode.replicas=3"])
    registry = create_registry(config)
    assert isinstance(registry, StaticRegistry)
    prefill = registry.list_workers(Role.PREFILL)
    assert [w.grpc_address for w in prefill] == ["127.0.0.1:18100", "127.0.0.1:18110"]
    assert len(registry.list_workers(Role.DECODE)) == 3
    assert prefill[1].events_endpoint == "tcp://127.0.0.1:18111"


def test_redis_entries_expire_without_heartbeat(tmp_path):
    with redis_server(tmp_path) as url:
        # b's beats are 0.2 s apart: only a stall of over 1.3 s in this thread drops it.
        registry = RedisRegistry(url, ttl_s=1.5, prefix="t")
        a, b = info("prefill-a"), info("decode-b", Role.DECODE)
        registry.register(a)
        registry.register(b)
        assert registry.list_workers() == [b, a]
        assert registry.list_workers(Role.DECODE) == [b]
        for _ in range(10):  # b keeps beating, a does not (2 s, past a's TTL)
            time.sleep(0.2)
            registry.heartbeat(b)
        assert [w.worker_id for w in registry.list_workers()] == ["decode-b"]
        registry.heartbeat(a)  # a comes back: its entry is re-created
        assert len(registry.list_workers()) == 2
        registry.deregister("decode-b")
        assert [w.worker_id for w in registry.list_workers()] == ["prefill-a"]
        registry.close()


def test_each_prefix_lists_its_own_workers_whatever_its_characters(tmp_path):
    """SCAN matches a glob: "team[eu]" listed nothing, "prod*" listed prod-eu's too."""
    with redis_server(tmp_path) as url:
        registries = {p: RedisRegistry(url, ttl_s=30, prefix=p)
                      for p in ("team[eu]", "prod*", "prod-eu", "a?c", "a\\b")}  # fmt: skip
        for prefix, registry in registries.items():
            registry.register(info(f"decode-{prefix}", Role.DECODE))
        for prefix, registry in registries.items():
            assert [w.worker_id for w in registry.list_workers()] == [f"decode-{prefix}"]
            registry.close()


def test_unreachable_redis_is_a_clear_error():
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(RegistryError, match="cannot reach the Redis registry"):
        RedisRegistry(url, ttl_s=1)


def test_a_redis_password_comes_from_the_environment_and_stays_out_of_errors(tmp_path, monkeypatch):
    """Rendered deployments keep the password out of their files and give it in
    PDSERVE_REDIS_PASSWORD; an error line showed the URL with its password."""
    with redis_server(tmp_path, password="hunter2") as url:
        with pytest.raises(RegistryError, match="cannot reach") as refused:
            RedisRegistry(url.replace("redis://", "redis://:wrong@"), ttl_s=1)
        assert "wrong" not in str(refused.value) and ":***@" in str(refused.value)
        monkeypatch.setenv("PDSERVE_REDIS_PASSWORD", "hunter2")
        registry = RedisRegistry(url, ttl_s=5, prefix="t")  # (the URL has none)
        registry.close()
        stale = url.replace("redis://", "redis://:old@")  # the variable outranks the URL's
        registry = RedisRegistry(stale, ttl_s=5, prefix="t")
        registry.register(info("prefill-a"))
        assert [w.worker_id for w in registry.list_workers()] == ["prefill-a"]
        registry.close()


def intent(name: str, state: str = "loaded") -> LoraIntent:
    return LoraIntent(name=name, path=f"/adapters/{name}", fingerprint="f1",
                      state=LoraIntentState(state))  # fmt: skip


def writes_in_order(registry: Registry) -> list:
    """Writes through ``registry``: each numbered after the last, ``if_seq`` kept."""
    first = registry.set_lora_intent(intent("alice"))
    other = registry.set_lora_intent(intent("bob"))
    stale = registry.set_lora_intent(intent("alice", "retiring"), if_seq=first.seq - 1)
    retiring = registry.set_lora_intent(intent("alice", "retiring"), if_seq=first.seq)
    fresh = registry.set_lora_intent(intent("carol"), if_seq=0)  # none yet
    taken = registry.set_lora_intent(intent("carol"), if_seq=0)
    return [first.seq, other.seq, stale, retiring.seq, fresh.seq, taken]


def test_lora_intents_in_one_process_under_a_static_list():
    registry = create_registry(load_config(None, []))
    assert writes_in_order(registry) == [1, 2, None, 3, 4, None]
    read = registry.lora_intents()["alice"]
    assert (read.state, read.seq, read.path) == (LoraIntentState.RETIRING, 3, "/adapters/alice")


def test_lora_intents_are_shared_through_redis_as_json(tmp_path):
    """One router's write is every router's read; the value is JSON (no pickle), and
    writes from two clients at once each get their own seq, the hash the last."""
    with redis_server(tmp_path) as url:
        one, two = RedisRegistry(url, ttl_s=5, prefix="t"), RedisRegistry(url, ttl_s=5, prefix="t")
        assert writes_in_order(one) == [1, 2, None, 3, 4, None]
        read = two.lora_intents()
        assert sorted(read) == ["alice", "bob", "carol"]
        assert (read["alice"].state, read["alice"].seq) == (LoraIntentState.RETIRING, 3)
        raw = one._client.hget("t:lora_intents", "alice")
        assert json.loads(raw)["state"] == "retiring"
        one._client.hset("t:lora_intents", mapping={"mallory": "not json", "eve": '{"name": 1}'})
        assert sorted(two.lora_intents()) == ["alice", "bob", "carol"]  # (said once)
        seqs: list[int] = []

        def write(registry: RedisRegistry, name: str) -> None:
            for _ in range(20):
                seqs.append(registry.set_lora_intent(intent(name)).seq)

        threads = [threading.Thread(target=write, args=(r, n)) for r, n in ((one, "x"), (two, "y"))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(seqs) == list(range(5, 45))
        read = one.lora_intents()
        assert max(read["x"].seq, read["y"].seq) == 44
        one.close()
        two.close()
