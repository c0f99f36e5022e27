"""The collectives of one tensor-parallel group: NCCL on CUDA, gloo on CPU.

The process group is built directly from a ``TCPStore`` (``ProcessGroupNCCL`` /
``ProcessGroupGloo``), not through ``torch.distributed.init_process_group``: that one is
process-global, so a process could hold only one group, and tests and the offline API
build several engines in one process. A single-rank engine uses ``SingleRank``, whose
collectives do nothing.
"""

from __future__ import annotations

import datetime
from typing import Protocol

import torch
import torch.distributed as dist


class TPGroup(Protocol):
    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group, in place; returns it."""
        ...

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (of one shape), by rank."""
        ...

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Rank ``src``'s ``tensor`` into every rank's (of one shape), in place; returns it."""
        ...

    def min_int(self, value: int) -> int:
        """The smallest ``value`` any rank passed (ranks agree on a size)."""
        ...

    def close(self) -> None: ...


class SingleRank:
    """The group of one: every collective is the identity."""

    rank = 0
    size = 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor]

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return tensor

    def min_int(self, value: int) -> int:
        return value

    def close(self) -> None:
        return None


def process_group(
    store: dist.Store, rank: int, size: int, backend: str, host: str, timeout_s: float
) -> dist.ProcessGroup:
    """A process group of ``size`` ranks met at ``store``, not registered process-wide:
    ``backend`` "nccl", or "gloo" with its sockets bound to ``host``. Its collectives fail
    after waiting ``timeout_s`` for a rank. Blocks until every rank has joined."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = timeout
        return dist.ProcessGroupGloo(store, rank, size, options)
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None:
        raise RuntimeError("this torch build has no NCCL")
    options = nccl.Options()
    options._timeout = timeout
    return nccl(store, rank, size, options)


class DistributedGroup:
    """``size`` processes that met at ``store``; ``device`` picks NCCL (cuda) or gloo
    (whose sockets bind to ``host``). A collective that waits longer than ``timeout_s``
    for a rank fails instead of hanging."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        device: torch.device,
        host: str,
        timeout_s: float,
    ) -> None:
        self.rank = rank
        self.size = size
        self.device = device
        backend = "nccl" if device.type == "cuda" else "gloo"
        self._group = process_group(store, rank, size, backend, host, timeout_s)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self._group.allreduce([tensor]).wait()
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        tensor = tensor.contiguous()
        gathered = [torch.empty_like(tensor) for _ in range(self.size)]
        self._group.allgather([gathered], [tensor]).wait()
        return gathered

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        options = dist.BroadcastOptions()
        options.rootRank = src
        self._group.broadcast([tensor], options).wait()
        return tensor

    def min_int(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self._group.allreduce([tensor], options).wait()
        return int(tensor.item())

    def close(self) -> None:
        shutdown = getattr(self._group, "shutdown", None)
        if shutdown is not None:
            shutdown()
