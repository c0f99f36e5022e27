"""Where the workers are: a static list from the config, or Redis with TTL heartbeats.

Redis layout: one hash per worker at ``{prefix}:worker:{worker_id}`` with the fields of
``WorkerInfo``, expiring after ``ttl_s`` unless the worker's heartbeat refreshes it. A
worker killed without warning therefore disappears within one TTL; a worker that shuts
down cleanly deletes its key at once. A draining worker keeps its key with
``draining=1`` until it exits, so routers stop placing new work on it.
"""

from __future__ import annotations

import logging
import re
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, fields

from common.config import PdserveConfig, Role
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
    return f"{role.value}@{host}:{grpc_port}"


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
                    grpc_address=f"{section.host}:{ports.grpc}",
                    events_endpoint=f"tcp://{section.host}:{ports.events}",
                    replay_endpoint=f"tcp://{section.host}:{ports.replay}",
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

    def close(self) -> None:
        return None


class StaticRegistry(Registry):
    """The workers the config lists; registration is a no-op (they are known up front)."""

    def __init__(self, config: PdserveConfig) -> None:
        self._workers = static_workers(config)

    def register(self, info: WorkerInfo) -> None:
        return None

    def heartbeat(self, info: WorkerInfo) -> None:
        return None

    def deregister(self, worker_id: str) -> None:
        return None

    def list_workers(self, role: Role | None = None) -> list[WorkerInfo]:
        return [w for w in self._workers if role is None or w.role is role]


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

    def close(self) -> None:
        self._client.close()


def create_registry(config: PdserveConfig) -> Registry:
    if config.registry.redis_url:
        return RedisRegistry(
            config.registry.redis_url, config.registry.ttl_s, config.registry.key_prefix
        )
    return StaticRegistry(config)
