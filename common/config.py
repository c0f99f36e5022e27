"""Configuration schema: the deployment (``PdserveConfig``) and its sections; the
engine's (``common/engine_config.py``) and the router's (``common/router_config.py``) have
files of their own. Torch-free, so the router and the CLI can validate without torch.

Each process builds its config once at its entry point and hands the fields down; configs
are frozen. Enum-typed fields accept their string values and are converted on construction,
so a config read from YAML and one written in Python compare equal.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from common.config_base import ConfigError, coerce_enums
from common.engine_config import SOME_16_BIT, EngineConfig, SpeculativeMethod, compute_dtype
from common.hosts import (
    HostError,
    IPAddress,
    addresses_overlap,
    host_addresses,
)
from common.redis_url import redis_url_problem
from common.router_config import RouterConfig


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class FailurePolicy(StrEnum):
    RECOMPUTE = "recompute"  # prefill locally on the decode worker; output unchanged
    FAIL = "fail"  # the request fails with a clear error


# Each worker owns PORT_STRIDE consecutive ports from its base port (see ``WorkerPorts``).
PORT_STRIDE = 10


@dataclass(frozen=True, slots=True)
class WorkerPorts:
    """The ports of one worker, all bound to its role's host."""

    grpc: int
    events: int  # ZMQ PUB: KV events
    replay: int  # ZMQ ROUTER: replay of recent event batches
    kv_transfer: int  # the connector's own listener, if it has one
    kv_store: int  # the connector's rendezvous store, if it has one

    @classmethod
    def from_base(cls, base: int) -> WorkerPorts:
        return cls(base, base + 1, base + 2, base + 3, base + 4)


@dataclass(frozen=True, slots=True)
class WorkerRoleConfig:
    """How many workers of one role, where they listen, and their engine differences."""

    replicas: int = 1
    host: str = "127.0.0.1"
    # Base port of replica 0; replica i starts at port + i * PORT_STRIDE.
    port: int = 18100
    # EngineConfig fields that differ for this role (e.g. a larger max_num_seqs on decode).
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)
    # SIGTERM: stop accepting, let in-flight requests finish for at most this long.
    drain_grace_s: float = 30.0

    def ports(self, index: int) -> WorkerPorts:
        return WorkerPorts.from_base(self.port + index * PORT_STRIDE)


@dataclass(frozen=True, slots=True)
class PrefillRoleConfig(WorkerRoleConfig):
    port: int = 18100


@dataclass(frozen=True, slots=True)
class DecodeRoleConfig(WorkerRoleConfig):
    port: int = 18200


# The connectors kv_transfer implements (kv_transfer.ConnectorName; common cannot import it).
CONNECTORS = ("nixl", "nccl", "shared_storage")


# A decode worker starts a pull only if it can end this long before the prefill worker's
# lease does: the Generate call's transit (the lease is timed on monotonic clocks, from
# the router's send), or, with a router or prefill worker from before, how far two
# hosts' wall clocks may disagree.
CLOCK_SKEW_S = 1.0


@dataclass(frozen=True, slots=True)
class KVTransferSettings:
    connector: str = "nixl"  # nixl | nccl | shared_storage
    lease_s: float = 30.0  # a prefill worker frees un-pulled KV after this long
    failure_policy: FailurePolicy = FailurePolicy.RECOMPUTE
    timeout_s: float = 10.0  # a pull that has not finished by then fails
    shared_dir: str | None = None  # shared_storage: the shared directory
    # shared_storage: bytes the shared directory may hold (all models and workers on it);
    # least recently used blocks are removed past it. 0: no cap (a full disk still frees
    # a tenth). Keep it well above what is in flight: lease_s of peak prefill output.
    shared_max_bytes: int = 0
    # nixl: read lanes (agent + thread each) a large pull is split over; 0: one per core up
    # to 4 on CPU memory, 1 on GPU memory. Lower it where the decode engine needs the cores.
    nixl_read_lanes: int = 0
    # nixl, CPU memory, two lanes or more: pin each lane to its own core. Turn it off where
    # several decode workers share the same cores (or give each worker its own cpuset).
    nixl_pin_lanes: bool = True

    def __post_init__(self) -> None:
        coerce_enums(self)
        if self.connector not in CONNECTORS:
            raise ConfigError(
                "kv_transfer.connector",
                f"{self.connector!r} is not one of: {', '.join(CONNECTORS)}",
            )
        if self.connector == "shared_storage" and not self.shared_dir:
            raise ConfigError(
                "kv_transfer.shared_dir", "the shared_storage connector needs a directory"
            )
        if self.lease_s <= 0:
            raise ConfigError("kv_transfer.lease_s", f"must be > 0, got {self.lease_s}")
        if self.shared_max_bytes < 0:
            raise ConfigError(
                "kv_transfer.shared_max_bytes",
                f"must be >= 0 (0: no cap), got {self.shared_max_bytes}",
            )
        if self.nixl_read_lanes < 0:
            raise ConfigError(
                "kv_transfer.nixl_read_lanes",
                f"must be >= 0 (0: automatic), got {self.nixl_read_lanes}",
            )
        if self.timeout_s <= 0:
            raise ConfigError("kv_transfer.timeout_s", f"must be > 0, got {self.timeout_s}")
        if self.timeout_s + CLOCK_SKEW_S >= self.lease_s:
            raise ConfigError(
                "kv_transfer.timeout_s",
                f"must be below lease_s={self.lease_s} by more than {CLOCK_SKEW_S:g} s (the "
                "allowance for a call's transit): a pull may not outlive its lease",
            )


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    # Size of each worker's CPU tier (pinned memory on CUDA); 0 disables it. A role's
    # engine.cpu_offload_bytes overrides it (the shared engine section may not set it).
    cpu_bytes: int = 0

    def __post_init__(self) -> None:
        if self.cpu_bytes < 0:
            raise ConfigError("offload.cpu_bytes", f"must be >= 0, got {self.cpu_bytes}")


@dataclass(frozen=True, slots=True)
class RegistryConfig:
    redis_url: str | None = None  # None: the static list this config implies
    ttl_s: float = 10.0
    heartbeat_s: float = 2.0
    key_prefix: str = "pdserve"

    def __post_init__(self) -> None:
        if not self.ttl_s >= 1:  # (Redis keeps whole milliseconds: 0.0009 s deleted at once)
            raise ConfigError("registry.ttl_s", f"must be at least 1 (seconds), got {self.ttl_s}")
        problem = None if self.redis_url is None else redis_url_problem(self.redis_url)
        if problem is not None:
            raise ConfigError("registry.redis_url", problem)
        if not 0 < self.heartbeat_s <= self.ttl_s / 2:  # one late heartbeat is no expiry
            raise ConfigError("registry.heartbeat_s", "must be > 0 and at most half of "
                                                      f"registry.ttl_s ({self.ttl_s})")  # fmt: skip


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """OpenTelemetry request traces (``common/tracing.py``): spans exported over OTLP/HTTP
    to ``otlp_traces_endpoint`` (a collector's ``http://host:4318/v1/traces``); None: off.
    ``sample_ratio``: the share of new traces recorded (a client's sampled trace context
    decides for its own requests)."""

    otlp_traces_endpoint: str | None = None
    sample_ratio: float = 1.0

    def __post_init__(self) -> None:
        endpoint = self.otlp_traces_endpoint
        if endpoint is not None and not endpoint.startswith(("http://", "https://")):
            raise ConfigError(
                "tracing.otlp_traces_endpoint",
                f"{endpoint!r} is not an http(s) URL (traces are sent as OTLP over HTTP: "
                "a collector's http://host:4318/v1/traces)",
            )
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ConfigError("tracing.sample_ratio", f"must be in [0, 1], got {self.sample_ratio}")


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """The router's live plan (``router/live_plan.py``): every ``interval_s`` it sizes what
    it served over the last ``window_s`` (``planner/sizing.py``) against a ``pdserve plan
    profile`` file and the targets (means, or the percentiles ``ttft_percentile`` and
    ``itl_percentile`` name), and shows the layout in its metrics
    (``pdserve:planned_replicas``): for an autoscaler to follow, or an operator to read.
    With ``autoscale``, ``pdserve up`` follows it itself: it starts workers and drains them
    between the minima here and each role's ``replicas`` (then the most it runs); a lower
    plan must hold for ``scale_in_delay_s`` before a worker is drained. ``correct``: scale
    the profile by how much slower or faster the workers were seen (the window's mean TTFT
    and ITL against the profile's prediction for the layout that served it)."""

    profile: str | None = None  # None: no live plan
    ttft_ms: float = 1000.0
    itl_ms: float = 50.0
    ttft_percentile: float | None = None  # None: ttft_ms is a mean; 90: a p90
    itl_percentile: float | None = None
    max_utilization: float = 0.85
    window_s: float = 60.0
    interval_s: float = 10.0
    correct: bool = True
    autoscale: bool = False
    min_prefill_replicas: int = 0
    min_decode_replicas: int = 1
    scale_in_delay_s: float = 120.0

    def __post_init__(self) -> None:
        for key in ("ttft_ms", "itl_ms", "window_s", "interval_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"planner.{key}", f"must be > 0, got {getattr(self, key)}")
        for key in ("ttft_percentile", "itl_percentile"):
            value = getattr(self, key)
            if value is not None and not 0 < value < 100:
                raise ConfigError(f"planner.{key}", f"must be in (0, 100), got {value}")
        if not 0 < self.max_utilization <= 1:
            raise ConfigError("planner.max_utilization",
                              f"must be in (0, 1], got {self.max_utilization}")  # fmt: skip
        if self.scale_in_delay_s < 0 or self.min_prefill_replicas < 0:
            raise ConfigError("planner", "scale_in_delay_s and min_prefill_replicas must be >= 0")
        if self.min_decode_replicas < 1:
            raise ConfigError("planner.min_decode_replicas", "at least one decode worker runs")
        if self.autoscale and self.profile is None:
            raise ConfigError("planner.autoscale", "needs planner.profile: the plan it follows "
                              "is sized from a profile (`pdserve plan profile`)")  # fmt: skip


# What a LoRA adapter may be called: it is the "model" clients pass and a path segment in
# the containers (/adapters/<name>).
_LORA_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


LORA_NAME_RULE = "1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"


def valid_lora_name(name: str) -> bool:
    return bool(_LORA_NAME.match(name))


@dataclass(frozen=True, slots=True)
class LoraSettings:
    """LoRA adapters every worker loads at start and keeps resident (engine/models/lora.py),
    and whether more may be loaded and unloaded while serving.

    A client picks one by passing its name as ``model``; the base model stays served under
    its own name. Prefill and decode workers load the same adapters (a request's KV is
    computed with its adapter on one and continued with it on the other)."""

    # name -> a PEFT adapter directory (adapter_config.json + adapter_model.safetensors).
    adapters: dict[str, str] = dataclasses.field(default_factory=dict)
    # The router's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's API),
    # and the workers' LoadLoraAdapter / UnloadLoraAdapter RPCs. Off by default: a load
    # names a directory the workers read, so it is for operators, not for every client.
    runtime_loading: bool = False
    max_adapters: int = 16  # loaded at once per worker, those of ``adapters`` included
    # An unload first waits this long at most for the adapter's requests in flight
    # through the router to finish (router/lora_adapters.py says why).
    unload_grace_s: float = 30.0

    def __post_init__(self) -> None:
        for name, path in self.adapters.items():
            if not valid_lora_name(name):
                raise ConfigError(f"lora.adapters.{name}", f"a name is {LORA_NAME_RULE}")
            if not path:
                raise ConfigError(f"lora.adapters.{name}", "needs the adapter's directory")
        if self.unload_grace_s < 0:
            raise ConfigError("lora.unload_grace_s", f"must be >= 0, got {self.unload_grace_s}")
        if self.max_adapters < max(1, len(self.adapters)):
            raise ConfigError(
                "lora.max_adapters",
                f"must be >= 1 and >= the {len(self.adapters)} of lora.adapters, "
                f"got {self.max_adapters}",
            )


@dataclass(frozen=True, slots=True)
class PdserveConfig:
    """One deployment: the model, the engine, the xPyD layout and the services around it."""

    model: str | None = None  # a local checkpoint; None: the built-in demo model
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    prefill: PrefillRoleConfig = dataclasses.field(default_factory=PrefillRoleConfig)
    decode: DecodeRoleConfig = dataclasses.field(default_factory=DecodeRoleConfig)
    kv_transfer: KVTransferSettings = dataclasses.field(default_factory=KVTransferSettings)
    offload: OffloadConfig = dataclasses.field(default_factory=OffloadConfig)
    router: RouterConfig = dataclasses.field(default_factory=RouterConfig)
    registry: RegistryConfig = dataclasses.field(default_factory=RegistryConfig)
    lora: LoraSettings = dataclasses.field(default_factory=LoraSettings)
    tracing: TracingConfig = dataclasses.field(default_factory=TracingConfig)
    planner: PlannerConfig = dataclasses.field(default_factory=PlannerConfig)

    def __post_init__(self) -> None:
        served = self.router.served_model_name
        if served and served in self.lora.adapters:
            raise ConfigError(
                f"lora.adapters.{served}", "is also router.served_model_name: names must differ"
            )
        for role in Role:
            section = self.role(role)
            if section.replicas < 0:
                raise ConfigError(f"{role}.replicas", f"must be >= 0, got {section.replicas}")
            if section.drain_grace_s < 0:
                raise ConfigError(
                    f"{role}.drain_grace_s", f"must be >= 0, got {section.drain_grace_s}"
                )
            try:
                self.engine_for(role)
            except ConfigError as exc:
                message = str(exc).split(": ", 1)[-1]
                raise ConfigError(f"{role}.engine.{exc.key.split('.')[-1]}", message) from None
        addresses = self._host_addresses()
        if self.engine.cpu_offload_bytes:  # (was silently replaced by offload.cpu_bytes)
            raise ConfigError("engine.cpu_offload_bytes", "a deployment's CPU tier is "
                              "offload.cpu_bytes (a role's engine.cpu_offload_bytes overrides "
                              "it for that role)")  # fmt: skip
        if self.decode.replicas < 1:
            raise ConfigError("decode.replicas", "at least one decode worker is needed")
        if self.engine_for(Role.PREFILL).block_size != self.engine_for(Role.DECODE).block_size:
            raise ConfigError(
                self._shared_key("block_size"),
                "prefill and decode must use the same block size: KV blocks move between them "
                "block for block, and the router hashes a prompt's blocks once for both",
            )
        tp_sizes = {role: self.engine_for(role).tensor_parallel_size for role in Role}
        if tp_sizes[Role.PREFILL] != tp_sizes[Role.DECODE]:
            raise ConfigError(
                self._shared_key("tensor_parallel_size"),
                f"prefill uses {tp_sizes[Role.PREFILL]} tensor-parallel ranks and decode "
                f"{tp_sizes[Role.DECODE]}: KV moves rank to rank (each holds its KV heads), so "
                "both roles need the same tensor_parallel_size",
            )
        kv_dtypes = {role: self.engine_for(role).kv_cache_dtype.storage_name for role in Role}
        if kv_dtypes[Role.PREFILL] != kv_dtypes[Role.DECODE]:
            names = {role: self.engine_for(role).kv_cache_dtype.value for role in Role}
            raise ConfigError(
                self._shared_key("kv_cache_dtype"),
                f"prefill stores KV as {names[Role.PREFILL]} and decode as "
                f"{names[Role.DECODE]}: KV blocks move between them byte for byte, so both "
                "roles need the same kv_cache_dtype",
            )
        self._check_compute_dtypes()
        # Settings both roles must share, and why.
        for key, why in (
            ("scheduling_policy", "the router takes a request's priority only when both "
                                  "roles honour it"),
            ("linear_state_dtype", "a hybrid model's states move between them byte for "
                                   "byte"),
            ("speculative_method", "with mtp or eagle3 the KV cache holds the drafting "
                                   "layer's KV too, which moves with the prompt's blocks, "
                                   "and a prefill worker's first drafts go with its token"),
        ):  # fmt: skip
            values = {role: getattr(self.engine_for(role), key) for role in Role}
            if values[Role.PREFILL] is not values[Role.DECODE]:
                raise ConfigError(
                    self._shared_key(key),
                    f"prefill has {key} {values[Role.PREFILL].value} and decode "
                    f"{values[Role.DECODE].value}: {why}, so both roles need the same {key}",
                )
        heads = {role: self.engine_for(role).draft_model for role in Role}
        eagle3 = self.engine_for(Role.DECODE).speculative_method is SpeculativeMethod.EAGLE3
        if eagle3 and heads[Role.PREFILL] != heads[Role.DECODE]:
            raise ConfigError(
                self._shared_key("draft_model"),
                f"prefill drafts with {heads[Role.PREFILL]} and decode with "
                f"{heads[Role.DECODE]}: an EAGLE-3 head's KV moves with the prompt's blocks, "
                "so both roles need the same head",
            )
        for role, least in ((Role.PREFILL, self.planner.min_prefill_replicas),
                            (Role.DECODE, self.planner.min_decode_replicas)):  # fmt: skip
            if self.planner.autoscale and least > self.role(role).replicas:
                raise ConfigError(
                    f"planner.min_{role}_replicas",
                    f"{least} is above {role}.replicas ({self.role(role).replicas}), the most "
                    "workers of the role autoscaling runs",
                )
        self._check_ports(addresses)

    def role(self, role: Role) -> WorkerRoleConfig:
        return self.prefill if role is Role.PREFILL else self.decode

    def _host_addresses(self) -> dict[str, frozenset[IPAddress]]:
        """Each configured host's addresses on this machine (``common/hosts.py``: literals
        need no lookup, a name is looked up once). ``ConfigError`` naming the key of a host
        that has none, or that a worker cannot use."""
        keyed = [("router.host", self.router.host)]
        keyed += [(f"{role}.host", self.role(role).host) for role in Role]
        addresses: dict[str, frozenset[IPAddress]] = {}
        for key, host in keyed:
            if host not in addresses:
                try:
                    addresses[host] = host_addresses(host)
                except HostError as exc:
                    raise ConfigError(key, str(exc)) from None
        for key, host in keyed[1:]:
            _check_worker_host(key, host, addresses[host])
        return addresses

    def _check_compute_dtypes(self) -> None:
        """The roles compute in one dtype. With ``kv_cache_dtype`` auto the KV cache holds
        it and blocks move between the roles byte for byte: a ``dtype`` or ``device``
        override that made them differ failed every pull at the handshake. With an fp8
        cache the blocks are rounded from it: a float32 prefill's blocks gave a bfloat16
        decode worker other tokens than it computes itself (a disaggregated reply was no
        colocated one), and shared storage keeps such blocks apart by the dtype that
        computed them, where the decode workers never found the prefill workers'. Refused
        here, where the key can be named. On CUDA auto is a 16-bit dtype (which one: the
        checkpoint's), on CPU float32; on an auto device, unknown."""
        engines = {role: self.engine_for(role) for role in Role}
        prefill, decode = (compute_dtype(engines[role]) for role in (Role.PREFILL, Role.DECODE))
        dtype_differs = engines[Role.PREFILL].dtype != engines[Role.DECODE].dtype
        if (prefill is None) != (decode is None) and (
            dtype_differs or "float32" in (prefill, decode)
        ):
            # One role's dtype (or a CPU device) set, the other's auto on an auto device:
            # float32 on a CPU, 16-bit on a GPU; either way not what the other says on one
            # of them. Passed, a decode dtype of bfloat16 alone recomputed every prompt, as
            # did a prefill device of cpu beside a decode worker's GPU.
            unknown = Role.PREFILL if prefill is None else Role.DECODE
            raise ConfigError(
                self._shared_key("dtype" if dtype_differs else "device"),
                f"{unknown}'s dtype is auto on an auto device (float32 on a CPU, 16-bit on a "
                f"GPU) and the other role computes in {prefill or decode}: decode continues "
                "from prefill's KV blocks, so set the same dtype (or device) on both roles",
            )
        if prefill is None or decode is None or prefill == decode:
            return
        if SOME_16_BIT in (prefill, decode) and "float32" not in (prefill, decode):
            return  # (auto on CUDA may be the other's 16-bit dtype)
        differs = "dtype" if dtype_differs else "device"
        raise ConfigError(
            self._shared_key(differs),
            f"prefill computes in {prefill} and decode in {decode}: decode continues from "
            "prefill's KV blocks (moved byte for byte, or rounded to the fp8 cache from "
            "prefill's dtype), so both roles need one dtype (set the same dtype and device)",
        )

    def _shared_key(self, name: str) -> str:
        """The key to blame for a setting both roles must share and do not: the role
        section that overrides it (decode's if both do), as the operator wrote it."""
        for role in (Role.DECODE, Role.PREFILL):
            if name in self.role(role).engine:
                return f"{role.value}.engine.{name}"
        return f"decode.engine.{name}"

    def engine_for(self, role: Role) -> EngineConfig:
        overrides = {"cpu_offload_bytes": self.offload.cpu_bytes, **self.role(role).engine}
        return self.engine.replace(**overrides)

    def bound_ports(self) -> list[tuple[str, int, str]]:
        """Each (host, port, owner) the layout binds: the router's port, then every
        worker's ``WorkerPorts``."""
        bound = [(self.router.host, self.router.port, "router.port")]
        for role in Role:
            section = self.role(role)
            for index in range(section.replicas):
                owner = f"{role}.port (replica {index})"
                ports = dataclasses.astuple(section.ports(index))
                bound += [(section.host, port, owner) for port in ports]
        return bound

    def _check_ports(self, addresses: dict[str, frozenset[IPAddress]]) -> None:
        """Every port the layout binds on one machine is distinct where the hosts' addresses
        overlap (``addresses_overlap``: ``localhost`` is 127.0.0.1, a wildcard is every
        address), given each host's ``addresses``."""
        owners: dict[int, list[tuple[str, str]]] = {}
        for host, port, owner in self.bound_ports():
            if not 0 < port < 65536:
                raise ConfigError(owner, f"port {port} is outside 1-65535")
            for other_host, other in owners.setdefault(port, []):
                if other != owner and addresses_overlap(addresses[host], addresses[other_host]):
                    where = "" if other_host == host else f" on {other_host}"
                    raise ConfigError(owner, f"port {port} on {host} is also used by {other}"
                                      f"{where}")  # fmt: skip
            owners[port].append((host, owner))


def _check_worker_host(key: str, host: str, addresses: frozenset[IPAddress]) -> None:
    """A worker's host is both where it listens and the address it registers: no wildcard
    (0.0.0.0, ::, or a name for one). IPv4 and IPv6 addresses both serve (an IPv6-only
    cluster's pod IP): gRPC, the ZMQ sockets (``common/zmq_tcp.py``), the NCCL store
    (``common/tcp_store.py``) and gloo take either."""
    if any(address.is_unspecified for address in addresses):
        raise ConfigError(
            key,
            f"{host} cannot be reached: a worker's host is both where it listens and the "
            "address it registers for the router and its peers; give this machine's address "
            "(the pod IP, the compose service name)",
        )
