"""``pdserve up``: each worker gets its ranks' share of the host's cores as
``OMP_NUM_THREADS``, not torch's every core for every process; a Kubernetes worker pod its
requested CPUs."""

from __future__ import annotations

from common.config import Role
from common.config_loader import load_config
from deploy.cpu_threads import usable_cores, worker_threads
from deploy.up import Stack
from tests.deploy.test_render import DEMO


def test_the_cores_are_shared_over_every_process():
    demo = load_config(str(DEMO))
    both = {(Role.PREFILL, 0), (Role.DECODE, 0)}
    assert worker_threads(demo, 2) == dict.fromkeys(both, 1)
    assert worker_threads(demo, 8) == dict.fromkeys(both, 4)
    assert worker_threads(demo, 1) == dict.fromkeys(both, 1)  # at least 1
    # Two decode workers and a prefill worker of 2 ranks each: 6 processes on 16 cores, 2
    # threads each; a worker is given its ranks' 4 (it shares them out itself).
    split = load_config(str(DEMO), ["decode.replicas=2", "engine.tensor_parallel_size=2"])
    assert worker_threads(split, 16) == {
        (Role.PREFILL, 0): 4, (Role.DECODE, 0): 4, (Role.DECODE, 1): 4,
    }  # fmt: skip


def test_workers_on_gpus_take_their_share_too():
    """Eight one-GPU workers on a 64-core host: 8 threads each, not 64 each."""
    eight = load_config(str(DEMO), ["engine.device=cuda", "decode.replicas=7"])
    shares = worker_threads(eight, 64)
    assert len(shares) == 8 and set(shares.values()) == {8}


def test_the_launcher_sets_the_share_unless_the_user_did(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    stack = Stack(load_config(str(DEMO)), tmp_path)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    share = str(max(1, usable_cores() // 2))
    assert stack._thread_env() == {
        (Role.PREFILL, 0): {"OMP_NUM_THREADS": share},
        (Role.DECODE, 0): {"OMP_NUM_THREADS": share},
    }
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert stack._thread_env() == {}


def test_a_worker_pod_takes_its_requested_cpus():
    from deploy.k8s_pods import WORKER_CONTAINER, worker

    pod = worker(load_config(str(DEMO)), Role.DECODE, "pdserve:cpu", "sum")
    (container,) = pod["spec"]["template"]["spec"]["containers"]
    (threads,) = [e for e in container["env"] if e["name"] == "OMP_NUM_THREADS"]
    assert threads["valueFrom"] == {"resourceFieldRef": {
        "containerName": WORKER_CONTAINER, "resource": "requests.cpu"}}  # fmt: skip
    assert container["name"] == WORKER_CONTAINER and container["resources"]["requests"]["cpu"]
