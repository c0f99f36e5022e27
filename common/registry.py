"""Where the workers are: a static list from the config, or Redis with TTL heartbeats.

Redis layout: one hash per worker at ``{prefix}:worker:{worker_id}`` with the fields of
``WorkerInfo``, expiring after ``ttl_s`` unless the worker's heartbeat refreshes it. A
worker killed without warning therefore disappears within one TTL; a worker that shuts
down cleanly deletes its key at once. A draining worker keeps its key with
``draining=1`` until it exits, so routers stop placing new work on it.

Runtime LoRA intents (``common/lora_intents.py``) live in one hash,
``{prefix}:lora_intents`` (adapter name -> the intent as JSON), numbered by the counter
``{prefix}:lora_intents:seq``; both change in one transaction. They never expire: an
unloaded adapter's tombstone is what keeps a late router from loading it again.
"""

from __future__ import annotations

import logging
import re
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, fields

import msgspec

from common.config import PdserveConfig, Role
from common.hosts import host_port
from common.lora_intents import LocalLoraIntents, LoraIntent, decode_intent, encode_intent
from common.redis_password import password_from_env, without_password

logger = logging.getLogger(__name__)


class RegistryError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    worker_id: str  # stable across restarts: "{role}@{host}:{grpc_port}"
    role: Role
    grpc_address: str  # host:port
    events_endpoint: str  # tcp://host:port (ZMQ PUB)
    replay_endpoint: str  # tcp://host:port (ZMQ ROUTER)
    model: str = ""
    engine_id: str = ""  # changes on every restart
    kv_blocks_total: int = 0
    block_size: int = 0
    connector: str = ""
    draining: bool = False

    def to_redis(self) -> dict[str, str]:
        return {k: str(int(v)) if isinstance(v, bool) else str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_redis(cls, data: dict[str, str]) -> WorkerInfo:
        values: dict = {}
        for f in fields(cls):
            raw = data.get(f.name)
            if raw is None:
                continue
            if f.type in ("int", int):
                values[f.name] = int(raw)
            elif f.type in ("bool", bool):
                values[f.name] = raw == "1"
            elif f.name == "role":
                values[f.name] = Role(raw)
            else:
                values[f.name] = raw
        return cls(**values)


def worker_id(role: Role, host: str, grpc_port: int) -> str:
    return f"{role.value}@{host_port(host, grpc_port)}"


def static_workers(config: PdserveConfig) -> list[WorkerInfo]:
    """Every worker the config describes, in role then replica order."""
    workers = []
    for role in Role:
        section = config.role(role)
        for index in range(section.replicas):
            ports = section.ports(index)
            workers.append(
                WorkerInfo(
                    worker_id=worker_id(role, section.host, ports.grpc),
                    role=role,
                    grpc_address=host_port(section.host, ports.grpc),
                    events_endpoint=f"tcp://{host_port(section.host, ports.events)}",
                    replay_endpoint=f"tcp://{host_port(section.host, ports.replay)}",
                    model=config.model or "demo",
                    block_size=config.engine_for(role).block_size,
                    connector=config.kv_transfer.connector,
                )
            )
    return workers


class Registry(ABC):
    @abstractmethod
    def register(self, info: WorkerInfo) -> None: ...

    @abstractmethod
    def heartbeat(self, info: WorkerInfo) -> None:
        """Refresh the worker's entry (re-creating it if it expired meanwhile)."""

    @abstractmethod
    def deregister(self, worker_id: str) -> None: ...

    @abstractmethod
    def list_workers(self, role: Role | None = None) -> list[WorkerInfo]: ...

    @abstractmethod
    def lora_intents(self) -> dict[str, LoraIntent]:
        """The routers' runtime LoRA intents (``common.lora_intents.LoraIntentStore``)."""

    @abstractmethod
    def set_lora_intent(self, intent: LoraIntent, if_seq: int | None = None) -> LoraIntent | None:
        """Write one (``common.lora_intents.LoraIntentStore``)."""

    def close(self) -> None:
        return None


class StaticRegistry(Registry):
    """The workers the config lists; registration is a no-op (they are known up front)."""

    def __init__(self, config: PdserveConfig) -> None:
        self._workers = static_workers(config)
        self._intents = LocalLoraIntents()  # one router: in process is exact

    def register(self, info: WorkerInfo) -> None:
        return None

    def heartbeat(self, info: WorkerInfo) -> None:
        return None

    def deregister(self, worker_id: str) -> None:
        return None

    def list_workers(self, role: Role | None = None) -> list[WorkerInfo]:
        return [w for w in self._workers if role is None or w.role is role]

    def lora_intents(self) -> dict[str, LoraIntent]:
        return self._intents.lora_intents()

    def set_lora_intent(self, intent: LoraIntent, if_seq: int | None = None) -> LoraIntent | None:
        return self._intents.set_lora_intent(intent, if_seq)


class RedisRegistry(Registry):
    def __init__(self, url: str, ttl_s: float, prefix: str = "pdserve") -> None:
        import redis

        self.ttl_ms = int(ttl_s * 1000)
        self.prefix = prefix
        self._malformed: set[str] = set()  # entries said to be unreadable (once each)
        # Rendered deployments keep the password out of the URL and give it here; given,
        # it outranks the URL's (redis-py's URL options outrank its keywords: stripped).
        password = password_from_env()
        self._client = redis.Redis.from_url(
            without_password(url) if password else url, socket_timeout=2.0,
            socket_connect_timeout=2.0, decode_responses=True,
            **({"password": password} if password else {}),
        )  # fmt: skip
        try:
            self._client.ping()
        except redis.RedisError as exc:
            shown = without_password(url, mask="***")  # error lines go to logs
            raise RegistryError(f"cannot reach the Redis registry at {shown}: {exc}") from exc

    def _key(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    def register(self, info: WorkerInfo) -> None:
        key = self._key(info.worker_id)
        pipe = self._client.pipeline()
        pipe.delete(key)
        pipe.hset(key, mapping=info.to_redis())
        pipe.pexpire(key, self.ttl_ms)
        pipe.execute()

    def heartbeat(self, info: WorkerInfo) -> None:
        if not self._client.pexpire(self._key(info.worker_id), self.ttl_ms):
            logger.warning("registry entry of %s had expired; registering again", info.worker_id)
            self.register(info)

    def deregister(self, worker_id: str) -> None:
        self._client.delete(self._key(worker_id))

    def list_workers(self, role: Role | None = None) -> list[WorkerInfo]:
        workers = []
        # The prefix is matched literally: SCAN reads a pattern, where "team[eu]" listed
        # nothing and "prod*" listed prod-eu's workers too.
        prefix = re.sub(r"([\\*?\[\]])", r"\\\1", self.prefix)
        for key in self._client.scan_iter(match=f"{prefix}:worker:*", count=100):
            data = self._client.hgetall(key)
            if not data:
                continue  # expired between scan and read
            try:
                info = WorkerInfo.from_redis(data)
            except (KeyError, ValueError, TypeError) as exc:
                if key not in self._malformed:  # (not at every refresh: a line a second)
                    self._malformed.add(key)
                    logger.warning("ignoring a registry entry this process cannot read at %s "
                                   "(a newer worker's?): %r", key, exc)  # fmt: skip
                continue
            if role is None or info.role is role:
                workers.append(info)
        return sorted(workers, key=lambda w: w.worker_id)

    def _intents_key(self) -> str:
        return f"{self.prefix}:lora_intents"

    def lora_intents(self) -> dict[str, LoraIntent]:
        import redis

        try:
            raw = self._client.hgetall(self._intents_key())
        except redis.RedisError as exc:
            raise RegistryError(f"cannot read the LoRA intents: {exc}") from exc
        intents = {}
        for name, value in raw.items():
            try:
                intents[name] = decode_intent(value)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                where = f"{self._intents_key()} {name}"
                if where not in self._malformed:  # (not at every refresh)
                    self._malformed.add(where)
                    logger.warning("ignoring the LoRA intent of %s in the registry, which "
                                   "this process cannot read (a newer router's?): %s",
                                   name, exc)  # fmt: skip
        return intents

    def set_lora_intent(self, intent: LoraIntent, if_seq: int | None = None) -> LoraIntent | None:
        """One optimistic transaction (WATCH, then MULTI): the write and its ``seq`` agree,
        and ``if_seq`` is checked against the intent the write replaces."""
        import redis

        key, seq_key = self._intents_key(), f"{self._intents_key()}:seq"

        def write(pipe: redis.client.Pipeline) -> LoraIntent | None:
            if if_seq is not None and _seq_of(pipe.hget(key, intent.name)) != if_seq:
                return None
            written = msgspec.structs.replace(intent, seq=int(pipe.get(seq_key) or 0) + 1)
            pipe.multi()
            pipe.set(seq_key, written.seq)
            pipe.hset(key, intent.name, encode_intent(written))
            return written

        try:
            return self._client.transaction(write, key, seq_key, value_from_callable=True)
        except redis.RedisError as exc:
            raise RegistryError(f"cannot write the LoRA intent of {intent.name}: {exc}") from exc

    def close(self) -> None:
        self._client.close()


def _seq_of(raw: str | None) -> int:
    """The ``seq`` of a stored intent; 0 for none, -1 for one this process cannot read
    (which no ``if_seq`` names)."""
    if raw is None:
        return 0
    try:
        return decode_intent(raw).seq
    except (msgspec.DecodeError, msgspec.ValidationError):
        return -1


def create_registry(config: PdserveConfig) -> Registry:
    if config.registry.redis_url:
        return RedisRegistry(
            config.registry.redis_url, config.registry.ttl_s, config.registry.key_prefix
        )
    return StaticRegistry(config)
