"""A torch ``TCPStore`` server that listens on one host only.

``TCPStore(host, port, is_master=True)`` ignores ``host`` for its own listening socket and
binds every interface: anyone who can reach the machine could read, write or delete the
group's rendezvous keys (NCCL's communicator ids among them) while it runs. Handing it a
socket already bound to ``host`` (``master_listen_fd``) keeps it there, in the host's
family: an IPv6 address, or a name with IPv6 addresses only, gets an IPv6 socket (torch's
clients connect to either). torch is imported when called, so this module stays importable
where torch is not installed.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

from common.hosts import socket_family


def bound_tcp_store(
    host: str, port: int, world_size: int | None, timeout_s: float, backlog: int = 128
) -> Any:  # -> torch.distributed.TCPStore
    """The store's server on ``host``:``port`` (0: a free port; read ``.port``)."""
    import torch.distributed as dist

    listener = socket.create_server((host, port), family=socket_family(host), backlog=backlog)
    return dist.TCPStore(
        host,
        listener.getsockname()[1],
        world_size,
        True,
        datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )
