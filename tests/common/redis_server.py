"""A real redis-server on a free port, started and stopped by the tests themselves."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def redis_server(workdir: Path, password: str | None = None) -> Iterator[str]:
    """Yields the server's URL (without ``password``, which the server then requires).
    Fails loudly if redis-server is not installed (the README's test command installs
    it)."""
    binary = shutil.which("redis-server")
    assert binary, "redis-server is not installed: apt-get install redis-server"
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
            *(["--requirepass", password] if password else []),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                time.sleep(0.05)
        else:
            raise RuntimeError("redis-server did not start")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def run_with_registry(workdir: Path, scenario: Callable[[Any], Awaitable[T]]) -> T:
    """``asyncio.run(scenario(registry))`` against a RedisRegistry on a fresh server."""
    import asyncio

    from common.registry import RedisRegistry

    with redis_server(workdir) as url:
        registry = RedisRegistry(url, ttl_s=30.0)
        try:
            return asyncio.run(scenario(registry))
        finally:
            registry.close()
