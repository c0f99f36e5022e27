"""How many torch threads each worker the launcher starts takes: the cores it may run on
shared out over every process it starts (each worker and its tensor-parallel ranks), at
least one each; a worker's ``OMP_NUM_THREADS`` is its ranks' together (it shares them out
over its ranks: ``engine/parallel/shard_client.py``, as in a Kubernetes pod, whose
requested CPUs it is). torch's default is every core for every process: on the demo's
two cores the prefill and the decode worker each ran two OpenMP threads, four busy
threads on two cores, whose spinning at barriers cost the engines their steps
(``DESIGN_NOTES.md``, "Threads of CPU workers"). Workers on GPUs take their share too:
their torch CPU work is small (batch metadata, the CPU KV tier's gathers), and eight of
them on a 64-core host would otherwise each start 64 threads for it (vLLM gives its GPU
workers one). A user's own ``OMP_NUM_THREADS`` is left alone (the launcher sets none
then). Torch-free."""

from __future__ import annotations

import os

from common.config import PdserveConfig, Role


def usable_cores() -> int:
    """The cores this process may run on (its affinity: ``taskset``, a cgroup cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def worker_threads(config: PdserveConfig, num_cores: int) -> dict[tuple[Role, int], int]:
    """(role, index) -> torch threads of all its ranks, for every worker of the config."""
    num_ranks = {
        (role, index): config.engine_for(role).tensor_parallel_size
        for role in Role
        for index in range(config.role(role).replicas)
    }
    share = max(1, num_cores // sum(num_ranks.values()))  # per process
    return {worker: share * ranks for worker, ranks in num_ranks.items()}
