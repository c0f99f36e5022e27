"""Settings of the KV-transfer layer, one frozen dataclass per process.

It will be folded into the deployment config (``kv_transfer:`` section); until then the
service builds it at its entry point. Each connector reads only the fields it uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from common.config_base import ConfigError


class ConnectorName(StrEnum):
    NIXL = "nixl"
    NCCL = "nccl"  # torch.distributed: NCCL on CUDA, gloo on CPU
    SHARED_STORAGE = "shared_storage"


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    connector: ConnectorName = ConnectorName.NIXL
    # Address every socket of the connector binds to, and advertises to peers.
    host: str = "127.0.0.1"
    # nccl: control socket (ZMQ) and rendezvous store (TCPStore) ports; 0 picks a free port
    # and the chosen one travels in the handshake metadata.
    port: int = 0
    store_port: int = 0
    # A fetch that has not finished this long after start_fetch fails (handshake included).
    # Keep it well below the exporter's lease: see ``KVConnector`` in base.py.
    timeout_s: float = 10.0
    # shared_storage: the shared directory, and a sub-directory per model so that equal
    # token prefixes of different models never share a file.
    shared_dir: str | None = None
    shared_namespace: str = "default"
    # shared_storage: bytes the whole shared directory may hold (every model and worker on
    # it); least recently used blocks are removed past it. 0: no cap.
    shared_max_bytes: int = 0
    # nccl: bytes of one staging buffer; a transfer moves ceil(bytes / staging_bytes)
    # layer groups, each one send/recv (double-buffered).
    staging_bytes: int = 64 << 20
    nixl_backends: tuple[str, ...] = ("UCX",)
    # UCX_NET_DEVICES for NIXL (UCX listens on every network device otherwise). None: "lo"
    # when ``host`` is loopback, else UCX's own choice; multi-node deployments name their
    # RDMA devices here (e.g. "mlx5_0:1"). An UCX_NET_DEVICES already in the environment wins.
    nixl_net_devices: str | None = None
    # UCX's own progress thread spins; on CPU hosts it halves the bandwidth, so by default
    # the connector's read lanes make progress themselves, only while READs are in flight.
    nixl_progress_thread: bool = False
    # NIXL read lanes (agent + thread each) a fetch is split over; 0: one per usable core
    # up to 4 on DRAM, where UCX copies on the CPU, and 1 on VRAM. A fetch is cut into
    # parts of at least nixl_lane_min_bytes, since a hand-off costs more than a small copy.
    nixl_read_lanes: int = 0
    nixl_lane_min_bytes: int = 2 << 20
    # On DRAM with two lanes or more, pin lane i to the i-th core the process may use:
    # left to the scheduler, lanes woken together often queued on one core while another
    # idled. Turn it off where several fetching workers share the same cores.
    nixl_pin_lanes: bool = True
    # A peer not fetched from for this long is forgotten (its connection, remote agent
    # and staging buffers go; a later fetch handshakes again): restarted workers come back
    # under new engine ids, and their old entries would otherwise stay for good. None:
    # max(300 s, 3 x timeout_s); it must exceed timeout_s (no fetch may still run).
    peer_idle_s: float | None = None
    # How often idle background threads look for new work or notifications.
    poll_interval_s: float = 0.002
    io_threads: int = 2  # shared_storage: concurrent file transfers
    # The engine's tensor parallelism: this connector moves rank tp_rank's KV heads, and
    # only to and from rank tp_rank of an engine of the same size (``KVLayout``).
    tp_size: int = 1
    tp_rank: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.connector, ConnectorName):
            try:
                object.__setattr__(self, "connector", ConnectorName(self.connector))
            except ValueError:
                choices = ", ".join(name.value for name in ConnectorName)
                raise ConfigError(
                    "kv_transfer.connector", f"{self.connector!r} is not one of: {choices}"
                ) from None
        object.__setattr__(self, "nixl_backends", tuple(self.nixl_backends))
        if self.timeout_s <= 0:
            raise ConfigError("kv_transfer.timeout_s", "must be positive")
        if self.peer_idle_s is None:
            object.__setattr__(self, "peer_idle_s", max(300.0, 3 * self.timeout_s))
        elif self.peer_idle_s <= self.timeout_s:
            raise ConfigError("kv_transfer.peer_idle_s", "must be above timeout_s")
        if self.poll_interval_s <= 0:
            raise ConfigError("kv_transfer.poll_interval_s", "must be positive")
        if self.staging_bytes <= 0:
            raise ConfigError("kv_transfer.staging_bytes", "must be positive")
        if self.nixl_read_lanes < 0:
            raise ConfigError("kv_transfer.nixl_read_lanes", "must be >= 0 (0: automatic)")
        if self.nixl_lane_min_bytes < 0:
            raise ConfigError("kv_transfer.nixl_lane_min_bytes", "must be >= 0")
        if self.shared_max_bytes < 0:
            raise ConfigError("kv_transfer.shared_max_bytes", "must be >= 0 (0: no cap)")
        if self.io_threads < 1:
            raise ConfigError("kv_transfer.io_threads", "must be at least 1")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError("kv_transfer.tp_rank", f"{self.tp_rank} of {self.tp_size} ranks")
        for key, port in (("port", self.port), ("store_port", self.store_port)):
            if not 0 <= port < 65536:
                raise ConfigError(f"kv_transfer.{key}", f"{port} is not a TCP port")
        if self.connector is ConnectorName.SHARED_STORAGE and not self.shared_dir:
            raise ConfigError("kv_transfer.shared_dir", "shared_storage needs a directory")
        if "/" in self.shared_namespace or self.shared_namespace in ("", ".", ".."):
            raise ConfigError("kv_transfer.shared_namespace", "must be one path component")
