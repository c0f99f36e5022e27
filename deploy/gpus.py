"""Which GPUs each worker gets on one host: consecutive runs of its
``tensor_parallel_size`` (rank r of a worker on the r-th of its GPUs), prefill workers
first, wrapping around when the host has fewer GPUs than the workers need (they then
share GPUs, which fits only small models)."""

from __future__ import annotations

import os
from pathlib import Path

from common.config import PdserveConfig, Role
from common.config_base import ConfigError


def worker_gpus(config: PdserveConfig, num_gpus: int = 0) -> dict[tuple[Role, int], list[int]]:
    """(role, index) -> GPU ordinals. ``num_gpus`` 0: as many as the workers need. Raises
    ``ConfigError`` when one worker needs more GPUs than there are (its ranks would share
    one, which NCCL refuses)."""
    assignment: dict[tuple[Role, int], list[int]] = {}
    next_gpu = 0
    for role in Role:
        tp_size = config.engine_for(role).tensor_parallel_size
        if num_gpus and tp_size > num_gpus:
            raise ConfigError(
                "engine.tensor_parallel_size",
                f"a {role.value} worker needs {tp_size} GPUs; the host has {num_gpus}",
            )
        for index in range(config.role(role).replicas):
            gpus = [next_gpu + rank for rank in range(tp_size)]
            assignment[(role, index)] = [g % num_gpus for g in gpus] if num_gpus else gpus
            next_gpu += tp_size
    return assignment


def gpus_needed(config: PdserveConfig) -> int:
    return sum(len(gpus) for gpus in worker_gpus(config).values())


def sharing_warning(config: PdserveConfig, num_gpus: int) -> str | None:
    """What a GPU shared by workers costs (None when none is): each worker sizes its KV
    cache to ``gpu_memory_utilization`` of its GPU's memory, so at the default the
    second worker to start on a GPU runs out of memory (``deploy compose --gpus`` gave
    this without a word)."""
    needed = gpus_needed(config)
    if not num_gpus or needed <= num_gpus:
        return None
    per_gpu = -(-needed // num_gpus)
    utilization = max(config.engine_for(role).gpu_memory_utilization for role in Role)
    return (
        f"the workers' ranks need {needed} GPUs and --gpus gives {num_gpus}: up to "
        f"{per_gpu} share a GPU, each sizing its KV cache to gpu_memory_utilization "
        f"({utilization:g}) of its memory, so the later ones run out of memory; set "
        f"engine.gpu_memory_utilization to at most {utilization / per_gpu:.2f} (the weights "
        "of every worker on a GPU beside), or give each rank a GPU of its own"
    )


def visible_gpus() -> list[str]:
    """This host's GPUs as ``CUDA_VISIBLE_DEVICES`` entries: that variable's list when set,
    else the NVIDIA driver's devices (torch-free: the launcher does not import torch)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [entry for entry in listed.split(",") if entry.strip()]
    driver = Path("/proc/driver/nvidia/gpus")
    count = len(list(driver.iterdir())) if driver.is_dir() else 0
    return [str(i) for i in range(count)]


def surely_no_cuda() -> bool:
    """Whether workers on this host surely find no CUDA device: ``CUDA_VISIBLE_DEVICES``
    lists none, or, unset, neither the NVIDIA driver lists a GPU nor a device node of
    one is there (``/dev/nvidiactl``; WSL's ``/dev/dxg``, where ``/proc`` lists none)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return not any(entry.strip() for entry in listed.split(","))
    nodes = (Path("/dev/nvidiactl"), Path("/dev/dxg"))
    return not visible_gpus() and not any(node.exists() for node in nodes)
