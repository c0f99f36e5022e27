"""A shard process: rank r >= 1 of a tensor-parallel engine (``python -m
engine.parallel.shard_main``, started by ``ShardClient`` with its ``ShardLaunch`` on stdin).

It holds its ``ModelShard`` (its heads' slice of the weights and of the KV cache) and
does what rank 0 says, in order (``messages.py``): run each step's forward pass (its
answer is the all-reduces inside it), copy blocks for the CPU tier, read and drop LoRA
adapters. Anything that raises ends the process after a ``Failed`` reply. A worker adds
its KV connector as an *extension*, which handles the connector's own commands and
reports its results.

A shard ends when rank 0 says so, or as soon as rank 0's process is gone, whatever it is
doing (a thread watches from the start: a shard still loading weights or waiting for the
group must not outlive its worker). It ignores SIGINT and SIGTERM: a Ctrl-C or a stop
signal to the worker's process group is the worker's to handle (a drain, during which
its ranks must keep stepping), and it stops them itself.
"""

from __future__ import annotations

import datetime
import importlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Protocol

import msgspec
import numpy as np
import torch
import zmq

from common.engine_config import EngineConfig
from common.gc_heap import freeze_startup_heap
from engine.cpu_tier import HostBlockCache
from engine.model_shard import HostBatch, ModelShard
from engine.models.arch import read_arch_config
from engine.models.lora import LoraAdapter, LoraBatch, load_lora_adapter
from engine.parallel.group import DistributedGroup
from engine.parallel.launch import ShardLaunch
from engine.parallel.messages import (
    TO_SHARD,
    AddLora,
    Allocate,
    DropLora,
    Failed,
    Hello,
    LoadBlocks,
    Loaded,
    LoraAdded,
    MtpPass,
    OpenHostCache,
    PlaceExperts,
    Probe,
    ProbeReply,
    SaveBlocks,
    Shutdown,
    Started,
    Step,
    decoder_of,
)
from engine.parallel.shard_spec import TensorParallel

logger = logging.getLogger("pdserve.shard")

_IDLE_POLL_MS = 100  # between looks at the extension's results when nothing comes
_BUSY_POLL_MS = 1  # while the extension has work in flight, whose results rank 0 awaits
_PARENT_POLL_S = 0.2  # how soon a shard notices that rank 0 is gone


class ShardExtension(Protocol):
    """Work a worker's shard does beside the model: its share of the KV connector."""

    message_types: tuple[type, ...]  # the commands it handles and the replies it sends

    def start(self, shard: ModelShard) -> bytes:
        """Once the KV cache exists (``shard``: the ``ModelShard``); what rank 0 learns."""
        ...

    def handle(self, message: Any) -> None: ...

    def poll(self) -> list[Any]:
        """Replies for rank 0 since the last call; never blocks."""
        ...

    @property
    def busy(self) -> bool:
        """Whether results may come soon (poll often)."""
        ...

    def close(self) -> None: ...


def _host_batch(message: Step | MtpPass) -> HostBatch:
    table = torch.frombuffer(bytearray(message.block_table), dtype=torch.int32)
    return HostBatch(
        message.input_ids, message.positions, message.slot_mapping,
        message.query_start_loc, message.seq_lens,
        table.view(len(message.seq_lens), message.block_table_width),
    )  # fmt: skip


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


class Shard:
    """The shard's state and its command handlers (one thread: the process's main)."""

    def __init__(self, launch: ShardLaunch, replies: zmq.Socket) -> None:
        self.launch = launch
        self._replies = replies
        self._encoder = msgspec.msgpack.Encoder()
        self.device = torch.device(launch.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.set_num_threads(launch.num_threads)
        self.reply(Hello(launch.rank))
        store = torch.distributed.TCPStore(
            launch.host, launch.store_port, None, False,
            timeout=datetime.timedelta(seconds=launch.timeout_s),
        )  # fmt: skip
        self.group = DistributedGroup(
            store, launch.rank, launch.size, self.device, launch.host, launch.timeout_s
        )
        self.config = EngineConfig(**launch.engine)
        self.arch = read_arch_config(launch.model_dir)
        self.shard = ModelShard(
            launch.model_dir, self.arch, self.config, self.device, _dtype(launch.dtype),
            launch.max_model_len, self.group,
        )  # fmt: skip
        self.host_cache: HostBlockCache | None = None
        self.adapters: dict[int, LoraAdapter] = {}  # adapter id -> this rank's cut of it
        self.extension: ShardExtension | None = None
        if launch.extension:
            module, _, function = launch.extension.partition(":")
            factory = getattr(importlib.import_module(module), function)
            self.extension = factory(launch.extension_config, launch.rank, launch.size)
        self.reply(Loaded(launch.rank, self.shard.max_num_blocks()))

    def reply(self, message: Any) -> None:
        self._replies.send(self._encoder.encode(message))

    def handle(self, message: Any) -> bool:
        """Apply one command; False once told to stop."""
        if isinstance(message, Step):
            self._step(message)
        elif isinstance(message, MtpPass):
            with torch.inference_mode():
                self.shard.mtp_pass(
                    _host_batch(message), message.hidden_rows, message.from_target,
                    message.logit_rows,
                )  # fmt: skip
        elif isinstance(message, PlaceExperts):
            self.shard.place_experts([tuple(p) for p in message.placements])
        elif isinstance(message, Allocate):
            self.shard.allocate(message.num_blocks)
            payload = self.extension.start(self.shard) if self.extension is not None else b""
            freeze_startup_heap()  # loaded and allocated: what is left is serving
            self.reply(Started(self.launch.rank, payload))
        elif isinstance(message, OpenHostCache):
            self.host_cache = HostBlockCache(self.shard.kv_caches, message.num_slots)
        elif isinstance(message, SaveBlocks):
            assert self.host_cache is not None, "SaveBlocks before OpenHostCache"
            self.host_cache.save(message.block_ids, message.slots)
        elif isinstance(message, LoadBlocks):
            assert self.host_cache is not None, "LoadBlocks before OpenHostCache"
            self.host_cache.load(message.slots, message.block_ids)
        elif isinstance(message, AddLora):
            self._add_lora(message)
        elif isinstance(message, DropLora):
            self.adapters.pop(message.adapter_id, None)
        elif isinstance(message, Probe):
            slots = self.host_cache.cpu_caches[0].shape[0] if self.host_cache is not None else 0
            self.reply(ProbeReply(self.launch.rank, len(self.adapters), slots))
        elif isinstance(message, Shutdown):
            return False
        else:
            assert self.extension is not None, f"unexpected command {message!r}"
            self.extension.handle(message)
        return True

    @torch.inference_mode()
    def _step(self, message: Step) -> None:
        batch = _host_batch(message)
        batch.key_ends = message.key_ends or None
        batch.rope_positions = message.rope_positions or None
        if message.mrope_positions:
            batch.mrope_positions = np.array(message.mrope_positions, dtype=np.int64)
        if self.shard.state_pool is not None:
            batch.state_slots, batch.fresh_slots = message.state_slots, message.fresh_slots
            batch.state_restores = message.state_restores
            batch.state_snapshots = message.state_snapshots
            batch.state_accepts, batch.state_drafts = message.state_accepts, message.state_drafts
        lora = None
        if message.lora_rows:
            lora = LoraBatch(
                tuple(
                    (self.adapters[adapter_id], self.shard.to_device(rows, torch.int64))
                    for adapter_id, rows in message.lora_rows
                )
            )
        images = None
        if message.image_rows:  # filled by rank 0's broadcast
            rows = self.shard.to_device(message.image_rows, torch.int64)
            vision = self.shard.arch.vision
            assert vision is not None
            # [m, hidden], or with DeepStack rows [m, (1 + K) * hidden]
            embeds = torch.empty(len(rows), vision.rows_width, dtype=self.shard.dtype,
                                 device=self.device)  # fmt: skip
            images = (rows, embeds)
        hidden = self.shard.forward(batch, lora, images)
        for rows in message.logit_rows:  # this rank's vocabulary slice, for rank 0
            self.shard.model.compute_logits(hidden[rows])

    def _add_lora(self, message: AddLora) -> None:
        try:
            adapter = load_lora_adapter(
                message.name, message.path, self.arch, self.device, self.shard.dtype,
                TensorParallel(self.launch.size, self.launch.rank),
            )  # fmt: skip
        except Exception as exc:  # the adapter's fault, not the shard's: it stays up
            self.reply(LoraAdded(self.launch.rank, message.adapter_id, error=str(exc)))
            return
        self.adapters[message.adapter_id] = adapter
        self.reply(LoraAdded(self.launch.rank, message.adapter_id, adapter.fingerprint))

    def serve(self, commands: zmq.Socket) -> None:
        extension_types = self.extension.message_types if self.extension is not None else ()
        decoder = decoder_of(TO_SHARD + extension_types)
        running = True
        while running:
            extension = self.extension
            timeout = _BUSY_POLL_MS if extension is not None and extension.busy else _IDLE_POLL_MS
            if commands.poll(timeout):
                running = self.handle(decoder.decode(commands.recv()))
            if extension is not None:
                for reply in extension.poll():
                    self.reply(reply)

    def close(self) -> None:
        if self.extension is not None:
            self.extension.close()
        self.group.close()


def _exit_with_parent(parent_pid: int, rank: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_POLL_S)
    logger.warning("rank %d: rank 0 is gone; exiting", rank)
    os._exit(1)


def main() -> int:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    launch = msgspec.json.decode(sys.stdin.buffer.read(), type=ShardLaunch)
    logging.basicConfig(
        level=launch.log_level,
        format=f"%(asctime)s rank{launch.rank} %(levelname)s %(name)s: %(message)s",
    )
    threading.Thread(
        target=_exit_with_parent, args=(launch.parent_pid, launch.rank), daemon=True
    ).start()
    context = zmq.Context()
    replies = context.socket(zmq.PUSH)
    replies.connect(launch.replies_endpoint)
    commands = context.socket(zmq.PULL)
    commands.connect(launch.commands_endpoint)
    shard: Shard | None = None
    code = 0
    try:
        shard = Shard(launch, replies)
        shard.serve(commands)
    except BaseException as exc:
        logger.error("rank %d failed:\n%s", launch.rank, traceback.format_exc())
        failed = Failed(launch.rank, f"{type(exc).__name__}: {exc}")
        replies.send(msgspec.msgpack.encode(failed))
        time.sleep(0.1)  # let the reply leave before the sockets close
        code = 1
    finally:
        if shard is not None:
            shard.close()
        commands.close(linger=0)
        replies.close(linger=1000)
        context.term()
    return code


if __name__ == "__main__":
    sys.exit(main())
