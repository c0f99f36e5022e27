"""How many torch threads each worker the launcher starts on this host's CPUs takes: the
cores it may run on shared out over every CPU process it starts (each worker and its
tensor-parallel ranks), at least one each; a worker's ``OMP_NUM_THREADS`` is its ranks'
together (it shares them out over its ranks: ``engine/parallel/shard_client.py``, as in a
Kubernetes pod, whose requested CPUs it is). torch's default is every core for every
process: on the demo's two cores the prefill and the decode worker each ran two OpenMP
threads, four busy threads on two cores, whose spinning at barriers cost the engines
their steps (``DESIGN_NOTES.md``, "Threads of CPU workers"). A user's own
``OMP_NUM_THREADS`` is left alone (the launcher sets none then). Workers on GPUs keep
torch's default: their torch CPU work is small. Torch-free."""

from __future__ import annotations

import os

from common.config import Device, PdserveConfig, Role


def usable_cores() -> int:
    """The cores this process may run on (its affinity: ``taskset``, a cgroup cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def worker_threads(
    config: PdserveConfig, num_cores: int, gpus_visible: bool
) -> dict[tuple[Role, int], int]:
    """(role, index) -> torch threads of all its ranks, for the workers whose engine runs
    on the CPU (``device: cpu``, or ``auto`` on a host without GPUs)."""
    on_cpu = {}
    for role in Role:
        engine = config.engine_for(role)
        if engine.device == Device.CPU or (engine.device == Device.AUTO and not gpus_visible):
            for index in range(config.role(role).replicas):
                on_cpu[(role, index)] = engine.tensor_parallel_size
    share = max(1, num_cores // sum(on_cpu.values())) if on_cpu else 0  # per process
    return {worker: share * num_ranks for worker, num_ranks in on_cpu.items()}
