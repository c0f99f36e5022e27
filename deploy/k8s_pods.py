"""The Kubernetes objects of a pdserve deployment, one builder per component.

Probes and shutdown, per component (reasons in deploy/README.md):

- worker: readiness = gRPC health (SERVING once the model and KV cache are ready;
  NOT_SERVING while loading or draining); liveness = the gRPC port accepting, since
  NOT_SERVING is a normal state, not a hung process. No preStop: SIGTERM itself starts the
  drain (registry entry marked draining, new requests refused and retried elsewhere by the
  router); terminationGracePeriodSeconds covers drain_grace_s plus shutdown.
- router: readiness = HTTP /health (503 while no decode worker is available or while
  draining); liveness = /metrics (always 200 while the server runs: a router without
  workers must not be restarted for it). preStop sleeps so the Service stops sending
  before the router starts refusing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from common.api_keys import API_KEYS_ENV, API_KEYS_SECRET
from common.config import PdserveConfig, Role
from common.engine_config import DType
from common.internal_auth import TOKEN_ENV
from common.redis_password import REDIS_PASSWORD_ENV, REDIS_PASSWORD_SECRET
from deploy import containers as c
from engine.models.arch import ModelLoadError
from engine.models.weight_count import loaded_weight_count

CONFIG = "pdserve-config"
REDIS = "pdserve-redis"
ROUTER = "pdserve-router"
KV_CLAIM = "pdserve-kv-shared"
MODEL_CLAIM = "pdserve-models"
LORA_CLAIM = "pdserve-lora"
DRAFT_CLAIM = "pdserve-draft-model"
WORKER_CONTAINER = "worker"
ROLE_LABEL = "pdserve.io/role"
CHECKSUM_ANNOTATION = "pdserve.io/config-sha256"
ROUTER_PRESTOP_S = 5
UID = 1000  # the image's pdserve user


# The internal gRPC ports' shared secret (``common/internal_auth.py``), from the Secret
# when the operator made one (``kubectl create secret generic pdserve-internal-token
# --from-literal=token=...``); without it the pods run without the check.
INTERNAL_TOKEN_SECRET = "pdserve-internal-token"


def _secret_env(name: str, secret: str, key: str, required: bool = False) -> dict[str, Any]:
    """The variable ``name`` from the Secret ``secret``'s ``key``; where ``required``, the
    pod does not start without it."""
    return {"name": name, "valueFrom": {"secretKeyRef": {
        "name": secret, "key": key, "optional": not required}}}  # fmt: skip


_INTERNAL_TOKEN = _secret_env(TOKEN_ENV, INTERNAL_TOKEN_SECRET, "token")


def _api_keys(config: PdserveConfig) -> dict[str, Any]:
    """The router's client keys (``common/api_keys.py``), never in the ConfigMap: from a
    Secret, required when the config has keys (the router must not start open)."""
    return _secret_env(API_KEYS_ENV, API_KEYS_SECRET, "keys", bool(config.router.api_keys))


def _redis_password(config: PdserveConfig) -> list[dict[str, Any]]:
    """An external Redis's password (``common/redis_password.py``), never in the
    ConfigMap: from a Secret, required when the config's URL had one."""
    needed = c.redis_password_needed(config)
    if needed is None:
        return []
    return [_secret_env(REDIS_PASSWORD_ENV, REDIS_PASSWORD_SECRET, "password", needed)]


def labels(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": component}


def worker_name(role: Role) -> str:
    return f"pdserve-{role.value}"


def _mounts_adapters(config: PdserveConfig) -> bool:
    return bool(config.lora.adapters) or config.lora.runtime_loading


def claims(config: PdserveConfig) -> list[dict[str, Any]]:
    """PersistentVolumeClaims: the shared-storage directory (read-write by every worker),
    the model directory (filled by you with the checkpoint; mounted read-only) and the
    LoRA adapters (filled by you with one directory per adapter name; read-only; with
    ``lora.runtime_loading`` also where adapters loaded later are put: the workers read
    ``/adapters/<dir>``), and a draft model's directory (filled by you; read-only)."""
    result = []
    if config.kv_transfer.connector == "shared_storage":
        result.append(_claim(KV_CLAIM, "50Gi"))
    if config.model is not None:
        result.append(_claim(MODEL_CLAIM, "100Gi"))
    if _mounts_adapters(config):
        result.append(_claim(LORA_CLAIM, "10Gi"))
    if c.draft_model_dir(config) is not None:
        result.append(_claim(DRAFT_CLAIM, "20Gi"))
    return result


def _claim(name: str, size: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "labels": labels("storage")},
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "resources": {"requests": {"storage": size}},
        },
    }


def redis() -> list[dict[str, Any]]:
    container = {
        "name": "redis",
        "image": c.REDIS_IMAGE,
        "args": ["--save", "", "--appendonly", "no"],
        "ports": [{"name": "redis", "containerPort": c.REDIS_PORT}],
        "readinessProbe": {"exec": {"command": ["redis-cli", "ping"]}, "periodSeconds": 2},
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10},
        "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}},
    }
    return [_deployment(REDIS, "redis", 1, {"containers": [container]}), _service(REDIS, "redis",
            [{"name": "redis", "port": c.REDIS_PORT, "targetPort": "redis"}])]  # fmt: skip


def router(config: PdserveConfig, image: str, checksum: str) -> list[dict[str, Any]]:
    port = config.router.port
    container = {
        "name": "router",
        "image": image,
        "args": c.router_args(),
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}, _INTERNAL_TOKEN, _api_keys(config),
                *_redis_password(config)],
        "ports": [{"name": "http", "containerPort": port}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 2},
        "livenessProbe": {"httpGet": {"path": "/metrics", "port": "http"},
                          "initialDelaySeconds": 30, "periodSeconds": 10,
                          "failureThreshold": 6},
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(ROUTER_PRESTOP_S)]}}},
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
        "volumeMounts": _mounts(config, worker=False),
    }  # fmt: skip
    grace = ROUTER_PRESTOP_S + c.stop_grace_s(config.router.drain_grace_s)
    spec = _pod_spec(config, container, grace, worker=False)
    ports = [{"name": "http", "port": port, "targetPort": "http"}]
    return [_deployment(ROUTER, "router", 1, spec, checksum), _service(ROUTER, "router", ports)]


def worker(config: PdserveConfig, role: Role, image: str, checksum: str) -> dict[str, Any]:
    section = config.role(role)
    ports = section.ports(0)
    named = [(f"{name.replace('_', '-')}", port)
             for name, port in dataclasses.asdict(ports).items()]  # fmt: skip
    memory_mib = worker_memory_bytes(config, role) // 2**20
    container = {
        "name": WORKER_CONTAINER,
        "image": image,
        "args": c.worker_args(role, 0, host="$(POD_IP)"),
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            # torch's threads: the CPUs the pod requests (rounded up), shared over the
            # worker's ranks; torch would count the node's cores.
            {"name": "OMP_NUM_THREADS", "valueFrom": {"resourceFieldRef": {
                "containerName": WORKER_CONTAINER, "resource": "requests.cpu"}}},
            _INTERNAL_TOKEN,
            *_redis_password(config),
        ],
        "ports": [{"name": name, "containerPort": port} for name, port in named],
        "readinessProbe": {"grpc": {"port": ports.grpc}, "periodSeconds": 2},
        "livenessProbe": {"tcpSocket": {"port": "grpc"}, "initialDelaySeconds": 30,
                          "periodSeconds": 10, "failureThreshold": 6},
        "resources": {"requests": {"cpu": "1", "memory": f"{memory_mib}Mi"}},
        "volumeMounts": _mounts(config, worker=True),
    }  # fmt: skip
    spec = _pod_spec(config, container, c.stop_grace_s(section.drain_grace_s), worker=True)
    # Never below the configured capacity during a rollout: a new pod is ready (model
    # loaded) before an old one drains.
    strategy = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    deployment = _deployment(
        worker_name(role), role.value, section.replicas, spec, checksum, strategy
    )
    for meta in (deployment["metadata"], deployment["spec"]["template"]["metadata"]):
        meta["labels"][ROLE_LABEL] = role.value
    return deployment


def worker_memory_bytes(config: PdserveConfig, role: Role) -> int:
    """Host memory a worker pod of the base (CPU) rendering requests: per tensor-parallel
    rank (a process each) its KV pool, its CPU tier and 1 GiB for the runtime, and the
    weights as the engine holds them on CPU, split over the ranks: as many elements as the
    files hold (FP8, MXFP4 and packed integer weights dequantized, ``weight_count.py``),
    float32 each unless ``engine.dtype`` says otherwise. The weights count when the model
    directory is readable where the config is rendered; a path that only exists in the
    cluster adds nothing (``deploy/README.md``: patch the request then)."""
    engine = config.engine_for(role)
    per_rank = engine.kv_cache_bytes + engine.cpu_offload_bytes + (1 << 30)
    total = per_rank * engine.tensor_parallel_size
    model = Path(config.model) if config.model else None
    if model is None or not (model / "config.json").is_file():
        return total
    try:
        num_weights = loaded_weight_count(model)
    except (ModelLoadError, OSError, ValueError, SafetensorError):
        return total
    held = 2 if engine.dtype in (DType.FLOAT16, DType.BFLOAT16) else 4
    return total + num_weights * held


def _mounts(config: PdserveConfig, worker: bool) -> list[dict[str, Any]]:
    mounts = [{"name": "config", "mountPath": "/etc/pdserve", "readOnly": True}]
    if worker:
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        if config.kv_transfer.connector == "shared_storage":
            mounts.append({"name": "kv-shared", "mountPath": c.SHARED_KV_DIR})
    model_path = c.container_model_path(config)
    if model_path is not None:
        mounts.append({"name": "models", "mountPath": model_path, "readOnly": True})
    if worker and _mounts_adapters(config):  # the router only needs the names
        mounts.append({"name": "lora", "mountPath": c.ADAPTERS_DIR, "readOnly": True})
    draft_path = c.container_draft_path(config)
    if worker and draft_path is not None:
        mounts.append({"name": "draft-model", "mountPath": draft_path, "readOnly": True})
    return mounts


def network_policy() -> dict[str, Any]:
    """Workers' ports (gRPC, KV events and replays, KV transfer) and Redis admit only the
    deployment's own pods: nothing else in the cluster may pull a cached prompt's KV,
    write a decode worker's cache or rewrite the registry. (The router's HTTP port is the
    public API and stays open; kubelet probes come from the node, which policies let
    through.)"""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "pdserve-internal", "labels": labels("network")},
        "spec": {
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "pdserve"},
                            "matchExpressions": [{"key": "app.kubernetes.io/component",
                                                  "operator": "In",
                                                  "values": [*(r.value for r in Role), "redis"]}]},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {
                "matchLabels": {"app.kubernetes.io/name": "pdserve"}}}]}],
        },
    }  # fmt: skip


def _pod_spec(
    config: PdserveConfig, container: dict[str, Any], grace_s: int, worker: bool
) -> dict[str, Any]:
    volumes: list[dict[str, Any]] = [{"name": "config", "configMap": {"name": CONFIG}}]
    if worker:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        if config.kv_transfer.connector == "shared_storage":
            volumes.append({"name": "kv-shared",
                            "persistentVolumeClaim": {"claimName": KV_CLAIM}})  # fmt: skip
    if config.model is not None:
        volumes.append({"name": "models", "persistentVolumeClaim": {
            "claimName": MODEL_CLAIM, "readOnly": True}})  # fmt: skip
    if worker and _mounts_adapters(config):
        volumes.append({"name": "lora", "persistentVolumeClaim": {
            "claimName": LORA_CLAIM, "readOnly": True}})  # fmt: skip
    if worker and c.draft_model_dir(config) is not None:
        volumes.append({"name": "draft-model", "persistentVolumeClaim": {
            "claimName": DRAFT_CLAIM, "readOnly": True}})  # fmt: skip
    return {
        "terminationGracePeriodSeconds": grace_s,
        "securityContext": {"runAsNonRoot": True, "runAsUser": UID, "fsGroup": UID},
        "containers": [container],
        "volumes": volumes,
    }


def _deployment(
    name: str,
    component: str,
    replicas: int,
    pod_spec: dict[str, Any],
    checksum: str = "",
    strategy: dict[str, Any] | None = None,
) -> dict[str, Any]:
    template_meta: dict[str, Any] = {"labels": labels(component)}
    if checksum:  # a changed config rolls the pods
        template_meta["annotations"] = {CHECKSUM_ANNOTATION: checksum}
    spec: dict[str, Any] = {"replicas": replicas, "selector": {"matchLabels": labels(component)}}
    if strategy is not None:
        spec["strategy"] = strategy
    spec["template"] = {"metadata": template_meta, "spec": pod_spec}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels(component)},
        "spec": spec,
    }


def _service(name: str, component: str, ports: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": labels(component)},
        "spec": {"selector": labels(component), "ports": ports},
    }
