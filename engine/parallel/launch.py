"""What a shard process is told at start (JSON on its stdin, never pickle), and what a
worker asks to add to it."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


@dataclass(frozen=True, slots=True)
class ShardExtensionSpec:
    """What a worker adds to each shard process of a tensor-parallel engine: its KV
    connector's share (``shard_main.ShardExtension``)."""

    factory: str  # "module:function", built in the shard from ``config``
    config: bytes
    message_types: tuple[type, ...]  # the extension's commands and replies


class ShardLaunch(msgspec.Struct, frozen=True, kw_only=True):
    rank: int
    size: int
    parent_pid: int  # the shard exits once this process is gone
    host: str  # the group's address: its TCPStore and gloo sockets
    store_port: int
    commands_endpoint: str  # ZMQ ipc: rank 0 PUSHes this shard's commands here
    replies_endpoint: str  # ZMQ ipc: the shards PUSH their replies to rank 0 here
    model_dir: str
    engine: dict  # common.engine_config.EngineConfig's fields
    device: str  # "cpu" or "cuda:RANK"
    dtype: str  # torch dtype name: "float32", "bfloat16", ...
    max_model_len: int
    timeout_s: float  # a collective or a start-up wait longer than this fails
    num_threads: int  # torch CPU threads (CPU engines: the cores are shared by the ranks)
    # A worker's extension ("module:function" building a ``ShardExtension``) and its
    # settings; "" for none (the offline engine).
    extension: str = ""
    extension_config: bytes = b""
    log_level: int = 20
