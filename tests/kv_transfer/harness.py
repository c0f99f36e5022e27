"""Test side of ``peer.py``: start a peer process and call it, with a timeout on every call."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import msgspec

REPO_ROOT = Path(__file__).resolve().parents[2]

# Small enough for a 2-core CI box, big enough for several descriptors, groups and files.
SMALL_LAYOUT = {
    "num_layers": 3,
    "num_blocks": 64,
    "block_size": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "dtype": "bfloat16",
}


class PeerError(RuntimeError):
    pass


class PeerProcess:
    """A ``tests.kv_transfer.peer`` subprocess."""

    def __init__(self, name: str) -> None:
        self.name = name
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.kv_transfer.peer"],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True).start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def call(self, op: str, timeout_s: float = 30.0, **kwargs: Any) -> dict[str, Any]:
        """Run one op in the peer; raise ``PeerError`` if it failed or did not answer."""
        assert self.process.stdin is not None
        self.process.stdin.write(msgspec.json.encode({"op": op, **kwargs}).decode() + "\n")
        self.process.stdin.flush()
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise PeerError(f"{self.name}: no answer to {op} within {timeout_s}s") from None
        if line is None:
            raise PeerError(f"{self.name}: exited (code {self.process.poll()}) during {op}")
        reply = msgspec.json.decode(line)
        if not reply.pop("ok"):
            raise PeerError(f"{self.name}: {op} failed: {reply['error']}")
        return reply

    def kill(self) -> None:
        """SIGKILL: no cleanup, sockets and memory vanish mid-whatever."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            try:
                self.process.stdin.write('{"op": "exit"}\n')
                self.process.stdin.flush()
            except OSError:
                pass  # already gone
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):  # a killed peer leaves a broken pipe
                self.process.stdin.close()


def start_peers(*names: str) -> list[PeerProcess]:
    """Start several peers at once (their imports overlap) and wait until each answers."""
    peers = [PeerProcess(name) for name in names]
    try:
        for peer in peers:
            peer.call("ping", timeout_s=60)
    except BaseException:
        for peer in peers:
            peer.close()
        raise
    return peers
