"""Rank 0's side of a tensor-parallel engine: starts the shard processes (ranks 1..size-1)
and talks to them.

Shards are plain subprocesses (``python -m engine.parallel.shard_main``) that read their
``ShardLaunch`` as JSON from stdin; commands and replies travel over ZMQ ``ipc://`` sockets
in a private temporary directory (nothing listens on the network but the group's
collectives, bound to ``host``); ``messages.py`` has the protocol.

Failures: a shard that reports ``Failed`` or exits is noticed by a watcher thread within
``_WATCH_S``, which records ``failure`` and calls ``on_failure`` (a worker turns that into
an engine failure at once; the step that was running fails by itself, since gloo and NCCL
collectives fail when a peer is gone or after the group's timeout). Every wait for a
shard's answer is bounded by ``timeout_s`` and gives up early once a shard is gone, so
nothing here waits for ever. ``close`` stops every shard (killing those that do not stop).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch
import zmq

from common.config_base import ConfigError
from common.engine_config import EngineConfig
from common.owned_paths import owner_tag, remove_dead_owners
from common.tcp_store import bound_tcp_store
from engine.models.arch import ModelArchConfig
from engine.parallel.group import DistributedGroup
from engine.parallel.launch import ShardExtensionSpec, ShardLaunch
from engine.parallel.messages import (
    FROM_SHARD,
    AddLora,
    Allocate,
    DropLora,
    Failed,
    Hello,
    LoadBlocks,
    Loaded,
    LoraAdded,
    OpenHostCache,
    Probe,
    ProbeReply,
    SaveBlocks,
    Shutdown,
    Started,
    decoder_of,
)
from engine.parallel.shard_spec import check_split, engine_split

logger = logging.getLogger(__name__)

_WATCH_S = 0.2  # how often the watcher looks at the shard processes
_STOP_S = 10.0  # how long close waits for a shard to exit before killing it


class ShardError(RuntimeError):
    """A shard failed to start, failed, or died; the message says which and why."""


class ShardClient:
    def __init__(
        self,
        size: int,
        launch: dict[str, Any],
        host: str,
        start_timeout_s: float,
        timeout_s: float,
        device_type: str = "cpu",
        extension_types: Sequence[type] = (),
    ) -> None:
        """Start ranks 1..size-1 (rank r on ``cuda:r`` for ``device_type`` cuda).
        ``launch``: the ``ShardLaunch`` fields every shard shares (all but rank, device,
        endpoints and the store). ``extension_types``: message types an extension adds to
        both directions (a worker's connector). ``start_timeout_s`` bounds each start-up
        wait (loading weights), ``timeout_s`` every wait after (the group's timeout)."""
        self.size = size
        self.device_type = device_type
        self.host = host
        self.start_timeout_s = start_timeout_s
        self.timeout_s = timeout_s
        self.failure: str | None = None
        self.on_failure: list[Callable[[str], None]] = []
        # This process's torch threads before the ranks took their share: given back at
        # close (each engine divided what the one before had left: 8, then 4, 2, 1).
        self.threads_before = torch.get_num_threads()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = decoder_of(FROM_SHARD + tuple(extension_types))
        self._extension_replies: deque[Any] = deque()
        self._next_adapter_id = 0
        self._dropped: deque[int] = deque()  # adapter ids to drop (any thread appends)
        # Mode 0700: ours alone. Named by owner, so the next client on this host removes
        # one a killed process left behind (its finalizer never ran).
        remove_dead_owners(Path(tempfile.gettempdir()), "pdserve-tp-")
        self._dir = tempfile.mkdtemp(prefix=f"pdserve-tp-{owner_tag()}-")
        self._context = zmq.Context()
        self._replies = self._context.socket(zmq.PULL)
        self._replies.bind(f"ipc://{self._dir}/replies")
        self._commands: list[zmq.Socket] = []
        # The group's rendezvous, on ``host`` alone; rank 0 joins it in ``join_group``.
        self.store = bound_tcp_store(host, 0, size, start_timeout_s)
        self._processes: list[subprocess.Popen] = []
        self._closing = False
        self._stop_watch = threading.Event()
        torch.set_num_threads(launch["num_threads"])  # this rank's share, as each shard's
        try:
            for rank in range(1, size):
                self._spawn(rank, launch)
        except BaseException:
            self.close()
            raise
        # The watcher holds the client weakly, and a finalizer stops the shards of an
        # engine nobody closed: they must not outlive it.
        threading.Thread(
            target=_watch,
            args=(weakref.ref(self), list(self._processes), self._stop_watch),
            name="tp-shard-watch",
            daemon=True,
        ).start()
        self._finalizer = weakref.finalize(
            self, _kill_all, list(self._processes), [*self._commands, self._replies],
            self._context, self._dir,
        )  # fmt: skip

    def _spawn(self, rank: int, launch: dict[str, Any]) -> None:
        commands = self._context.socket(zmq.PUSH)
        endpoint = f"ipc://{self._dir}/commands-{rank}"
        commands.bind(endpoint)
        self._commands.append(commands)
        spec = ShardLaunch(
            rank=rank,
            size=self.size,
            parent_pid=os.getpid(),
            host=self.host,
            store_port=self.store.port,
            commands_endpoint=endpoint,
            replies_endpoint=f"ipc://{self._dir}/replies",
            device=f"cuda:{rank}" if self.device_type == "cuda" else "cpu",
            **launch,
        )
        process = subprocess.Popen(
            [sys.executable, "-m", "engine.parallel.shard_main"], stdin=subprocess.PIPE
        )
        assert process.stdin is not None
        process.stdin.write(msgspec.json.encode(spec))
        process.stdin.close()
        self._processes.append(process)

    # ------------------------------------------------------------------ start-up

    def wait_hello(self) -> None:
        """Until every shard runs (imports done): then the group can form quickly."""
        self._wait_all(Hello, "start", self.start_timeout_s)

    def join_group(self) -> DistributedGroup:
        """Join the group as rank 0 (after ``wait_hello``). Forming it blocks in C++ until
        every rank has joined, so it runs on a thread while this one watches the shards: a
        shard that dies meanwhile fails this at once, not at the group's timeout (the
        thread then ends at that timeout by itself)."""
        device = torch.device("cuda", 0) if self.device_type == "cuda" else torch.device("cpu")
        joined: dict[str, Any] = {}

        def join() -> None:
            try:
                joined["group"] = DistributedGroup(
                    self.store, 0, self.size, device, self.host, self.timeout_s
                )
            except BaseException as exc:  # re-raised on the caller's thread
                joined["error"] = exc

        thread = threading.Thread(target=join, name="tp-group-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(_WATCH_S)
            self._raise_if_failed()
        if "error" in joined:
            raise joined["error"]
        return joined["group"]

    def wait_loaded(self) -> int:
        """Until every shard loaded its weights; the fewest KV blocks any of them holds."""
        loaded = self._wait_all(Loaded, "load the model", self.start_timeout_s)
        return min(reply.max_num_blocks for reply in loaded)

    def allocate(self, num_blocks: int) -> None:
        self.send(Allocate(num_blocks))

    def wait_started(self) -> list[bytes]:
        """Until every shard allocated its cache; each one's extension payload (rank 1..)."""
        started = self._wait_all(Started, "allocate its KV cache", self.start_timeout_s)
        return [reply.extension for reply in started]

    def _wait_all(self, kind: type, what: str, timeout_s: float | None = None) -> list[Any]:
        got: dict[int, Any] = {}
        timeout_s = timeout_s or self.timeout_s
        deadline = time.monotonic() + timeout_s
        while len(got) < self.size - 1:
            reply = self._receive(deadline, f"{what} (rank(s) {self._missing(got)})", timeout_s)
            if isinstance(reply, kind):
                got[reply.rank] = reply
        return [got[rank] for rank in range(1, self.size)]

    def _missing(self, got: dict[int, Any]) -> str:
        return ", ".join(str(r) for r in range(1, self.size) if r not in got)

    def _receive(self, deadline: float, waiting_for: str, timeout_s: float) -> Any:
        """The next engine-level reply (extension replies are queued); raises
        ``ShardError`` if a shard failed or ``deadline`` passes."""
        while True:
            self._raise_if_failed()
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise ShardError(
                    f"tensor-parallel shards did not {waiting_for} within {timeout_s:g} s"
                )
            if not self._replies.poll(min(remaining_ms, int(_WATCH_S * 1000))):
                continue
            reply = self._take(self._replies.recv())
            if reply is not None:
                return reply

    def _take(self, data: bytes) -> Any:
        """Sort one reply: failures recorded, extension replies queued; else returned."""
        reply = self._decoder.decode(data)
        if isinstance(reply, Failed):
            self._fail(f"tensor-parallel rank {reply.rank} failed: {reply.reason}")
            return None
        if isinstance(reply, FROM_SHARD):
            return reply
        self._extension_replies.append(reply)
        return None

    # ------------------------------------------------------------------ serving

    def send(self, message: Any) -> None:
        """The same command to every shard, in order after everything sent before."""
        if self._closing:
            raise ShardError("the engine is closed: its tensor-parallel ranks are stopped")
        self._raise_if_failed()
        while self._dropped:  # adapters rank 0 let go of since the last command
            self._send_raw(self._encoder.encode(DropLora(self._dropped.popleft())))
        self._send_raw(self._encoder.encode(message))

    def _send_raw(self, data: bytes) -> None:
        """Queue ``data`` for every shard. A PUSH socket whose peer is gone would block
        for ever, so this waits at most ``timeout_s`` and gives up once a shard failed."""
        for socket in self._commands:
            deadline = time.monotonic() + self.timeout_s
            while True:
                try:
                    socket.send(data, zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    if self._closing:
                        return
                    self._raise_if_failed()
                    if time.monotonic() > deadline:
                        raise ShardError("a tensor-parallel shard takes no commands") from None
                    socket.poll(int(_WATCH_S * 1000), zmq.POLLOUT)

    def open_host_cache(self, num_slots: int) -> None:
        self.send(OpenHostCache(num_slots))

    def save(self, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        self.send(SaveBlocks(list(block_ids), list(slots)))

    def load(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        self.send(LoadBlocks(list(slots), list(block_ids)))

    def add_lora(self, name: str, path: str, fingerprint: str) -> int:
        """Make every shard read adapter ``name`` at ``path``; its id for ``Step``. Raises
        ``ShardError`` if a shard cannot read it or reads other files than rank 0 did
        (``fingerprint``); no shard holds it then."""
        adapter_id = self._next_adapter_id
        self._next_adapter_id += 1
        self.send(AddLora(adapter_id, name, path))
        replies: dict[int, LoraAdded] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(replies) < self.size - 1:
            reply = self._receive(deadline, f"read LoRA adapter {name!r}", self.timeout_s)
            if isinstance(reply, LoraAdded) and reply.adapter_id == adapter_id:
                replies[reply.rank] = reply
        problems = [
            f"rank {r.rank}: {r.error}"
            if r.error
            else f"rank {r.rank} read other files ({r.fingerprint}, rank 0: {fingerprint})"
            for r in replies.values()
            if r.error or r.fingerprint != fingerprint
        ]
        if problems:
            self.send(DropLora(adapter_id))
            raise ShardError(f"LoRA adapter {name!r} at {path}: " + "; ".join(problems))
        return adapter_id

    def probe(self) -> list[ProbeReply]:
        """What each shard holds (rank 1..), after every command sent before."""
        self.send(Probe())
        return self._wait_all(ProbeReply, "answer a probe")

    def lora_dropper(self) -> Callable[[int], None]:
        """What to call with an adapter's id once rank 0 let go of it (any thread, e.g. the
        garbage collector's): the shards drop it before the next command. It holds the
        queue alone: a finalizer holding this client kept a dropped engine's ranks alive
        for as long as its caller kept an adapter."""
        return self._dropped.append

    def extension_replies(self) -> list[Any]:
        """The extension's replies that arrived so far (never blocks)."""
        while self._replies.poll(0):
            reply = self._take(self._replies.recv())
            if reply is not None:
                logger.warning("unexpected reply from a shard: %r", reply)
        replies = list(self._extension_replies)
        self._extension_replies.clear()
        return replies

    # ------------------------------------------------------------------ failures, stop

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise ShardError(self.failure)

    def fail(self, reason: str) -> None:
        """Take the group out of service: rank 0 left a step half done (an exception
        between sending it and its last collective), so the ranks are out of step and
        every later collective would pair with the wrong one. Nothing is sent any more."""
        self._fail(f"tensor-parallel ranks out of step: {reason}")

    def _fail(self, reason: str) -> None:
        if self.failure is not None or self._closing:
            return
        self.failure = reason
        logger.error("%s", reason)
        for callback in self.on_failure:
            with contextlib.suppress(Exception):  # a callback must not stop the others
                callback(reason)

    def find_exited(self, wait_s: float = 0.0) -> None:
        """Record the first shard that exited (waiting up to ``wait_s`` for one to), for
        a clearer failure than the collective error its exit caused."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, process in enumerate(self._processes, start=1):
                code = process.poll()
                if code is not None:
                    self._fail(f"tensor-parallel rank {rank} exited with code {code}")
                    return
            if time.monotonic() >= deadline:
                return
            time.sleep(0.01)

    def close(self) -> None:
        """Stop every shard (killing those that do not stop, at once if the group failed:
        a shard may be stuck in a collective) and free everything."""
        if self._closing:
            return
        self._closing = True
        self._stop_watch.set()
        with contextlib.suppress(zmq.ZMQError):
            self._send_raw(self._encoder.encode(Shutdown()))
        deadline = time.monotonic() + (_STOP_S if self.failure is None else 0.0)
        for process in self._processes:
            try:
                process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        torch.set_num_threads(self.threads_before)
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()  # the sockets and the directory
        else:  # the constructor failed before making it
            _kill_all(self._processes, [*self._commands, self._replies], self._context, self._dir)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes]


def _watch(
    client_ref: weakref.ref[ShardClient],
    processes: list[subprocess.Popen],
    stop: threading.Event,
) -> None:
    while not stop.wait(_WATCH_S):
        if any(process.poll() is not None for process in processes):
            client = client_ref()
            if client is not None:
                client.find_exited()
            return


def _kill_all(
    processes: list[subprocess.Popen],
    sockets: list[zmq.Socket],
    context: zmq.Context,
    directory: str,
) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()
    for socket in sockets:
        socket.close(linger=0)
    context.term()
    shutil.rmtree(directory, ignore_errors=True)


# The group is one machine's: its collectives and rendezvous stay on the loopback.
GROUP_HOST = "127.0.0.1"
# How long a shard may take to load its weights (and rank 0 waits for it).
_START_TIMEOUT_S = 1800.0


def _worker_threads() -> int:
    """``OMP_NUM_THREADS`` (its first level) when set: the same however many engines this
    process starts (each divides it anew); else this process's torch threads now."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "").split(",")[0]))
    except ValueError:
        return torch.get_num_threads()


def launch_shards(
    model_dir: str | Path,
    arch: ModelArchConfig,
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
    extension: ShardExtensionSpec | None = None,
) -> ShardClient:
    """Start ranks 1.. of a ``config.tensor_parallel_size`` group; rank 0 then joins it
    (``wait_hello``, ``join_group``).
    Raises ``ModelLoadError`` / ``ConfigError`` before starting anything if the model
    does not split, or the devices are too few."""
    size = config.tensor_parallel_size
    check_split(arch, engine_split(config, 0))
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ConfigError(
            "engine.tensor_parallel_size",
            f"{size} ranks need {size} GPUs; {torch.cuda.device_count()} are visible",
        )
    # Collectives wait this long for a rank: longer than any step may take.
    timeout_s = max(60.0, config.step_timeout_s or 600.0)
    # The worker's torch threads (``OMP_NUM_THREADS``: ``pdserve up`` and the Kubernetes
    # pods set it to the worker's cores; else this process's, torch's every core) are
    # shared out over its ranks: this one keeps its share, each shard gets the same.
    threads_per_rank = max(1, _worker_threads() // size)
    launch = dict(
        model_dir=str(model_dir),
        engine=msgspec.to_builtins(config),
        dtype=str(dtype).removeprefix("torch."),
        max_model_len=max_model_len,
        timeout_s=timeout_s,
        num_threads=threads_per_rank,
        log_level=logging.getLogger().getEffectiveLevel(),
    )
    if extension is not None:
        launch.update(extension=extension.factory, extension_config=extension.config)
    return ShardClient(
        size, launch, GROUP_HOST, _START_TIMEOUT_S, timeout_s, device.type,
        extension.message_types if extension is not None else (),
    )  # fmt: skip
