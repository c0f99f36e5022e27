"""Warn when a configured port lies in the OS's ephemeral range.

Linux hands out ports in ``net.ipv4.ip_local_port_range`` (32768-60999 by default) to
outgoing connections. A server port inside that range can be held by some client's
connection at the moment the worker binds it, and the bind fails ("Address already in
use") for no fault of the config. pdserve's defaults (router 8000, prefill 18100, decode
18200) sit below the range; this warns about configs that moved into it.
"""

from __future__ import annotations

from pathlib import Path

from common.config import PdserveConfig

PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_range(path: Path = PORT_RANGE_FILE) -> range | None:
    """The OS's ephemeral ports (inclusive bounds as a range), or None where unknown."""
    try:
        low, high = (int(word) for word in path.read_text().split())
    except (OSError, ValueError):
        return None
    return range(low, high + 1)


def ephemeral_port_warnings(config: PdserveConfig, ports: range | None) -> list[str]:
    """One line per owner (router, worker replica) with ports inside ``ports``."""
    if ports is None:
        return []
    inside: dict[str, list[int]] = {}
    for _host, port, owner in config.bound_ports():
        if port in ports:
            inside.setdefault(owner, []).append(port)
    return [
        f"{owner}: ports {', '.join(map(str, found))} lie in the OS's ephemeral range "
        f"{ports.start}-{ports.stop - 1}; an outgoing connection can hold one when the "
        "process binds it (choose ports below the range)"
        for owner, found in inside.items()
    ]
