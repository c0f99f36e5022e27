"""Render Kubernetes manifests from a deployment config: a kustomize base plus a GPU overlay.

    base/       ConfigMap (the container config), Redis, router Deployment + Service,
                prefill and decode Deployments (replicas from the config), PVCs if needed,
                a NetworkPolicy keeping the internal ports to the deployment's pods
    overlays/gpu/  the CUDA image and tensor_parallel_size nvidia.com/gpu per worker pod
    overlays/autoscale/  with ``planner.profile``: a KEDA ScaledObject per role on the
                   router's ``pdserve:planned_replicas`` (set PROMETHEUS there)

Every worker pod is replica 0 of its own network namespace: same ports in every pod, host
= its pod IP (downward API), discovery through Redis; so a Deployment's replica count is
the config's, and ``kubectl scale`` adds or removes workers the router picks up (scaled-in
pods drain on SIGTERM). Pod specs are built in ``deploy/k8s_pods.py``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import yaml

from common.config import PdserveConfig, Role
from common.config_base import ConfigError
from deploy import containers as c
from deploy import k8s_pods as pods
from deploy.yaml_text import dump_all

KUSTOMIZE_API = "kustomize.config.k8s.io/v1beta1"


def render_files(
    config: PdserveConfig, source: str, image: str = "", prometheus_url: str = ""
) -> dict[str, str]:
    """Relative path → YAML text: ``base/...``, ``overlays/gpu/...`` and, with
    ``planner.profile``, ``overlays/autoscale/...`` (KEDA asking ``prometheus_url``, or
    ``PROMETHEUS`` when it is empty)."""
    image = image or c.default_image()
    base = base_resources(config, source, image)
    header = f"# Rendered by `pdserve deploy k8s` from {source}; re-render, do not edit.\n"
    files = {f"base/{name}": header + dump_all(docs) for name, docs in base.items()}
    kustomization = {"apiVersion": KUSTOMIZE_API, "kind": "Kustomization",
                     "resources": list(base)}  # fmt: skip
    files["base/kustomization.yaml"] = header + dump_all([kustomization])
    gpus_per_pod = config.engine_for(Role.PREFILL).tensor_parallel_size  # equal for both
    for name, docs in gpu_overlay(image, gpus_per_pod).items():
        files[f"overlays/gpu/{name}"] = header + dump_all(docs)
    if config.planner.profile is not None:
        for name, docs in autoscale_overlay(config, prometheus_url or PROMETHEUS).items():
            files[f"overlays/autoscale/{name}"] = header + dump_all(docs)
    return files


def render_stream(config: PdserveConfig, source: str, image: str = "") -> str:
    """The base as one multi-document stream (``kubectl apply -f -``), no kustomize."""
    image = image or c.default_image()
    docs = [doc for group in base_resources(config, source, image).values() for doc in group]
    return f"# Rendered by `pdserve deploy k8s` from {source}.\n" + dump_all(docs)


def write(files: dict[str, str], out_dir: Path) -> None:
    for relative, text in files.items():
        path = out_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def base_resources(config: PdserveConfig, source: str, image: str) -> dict[str, list[dict]]:
    """File name → the resources it holds, in apply order."""
    # An IPv6-only cluster's router listens on "::" (``deploy/containers.py``).
    router_host = "::" if config.router.host == "::" else "0.0.0.0"
    inner = c.container_config(config, redis_host=pods.REDIS, router_host=router_host)
    config_text = c.config_yaml(inner, source)
    # What the pods run on: scaling a role (1 -> 3 replicas) must not roll every pod, so
    # replica counts enter the checksum only as "runs or not".
    # (planner.autoscale is the local launcher's, and its minima would not fit the 0 or 1.)
    scaled = dataclasses.replace(
        inner,
        prefill=dataclasses.replace(inner.prefill, replicas=min(inner.prefill.replicas, 1)),
        decode=dataclasses.replace(inner.decode, replicas=min(inner.decode.replicas, 1)),
        planner=dataclasses.replace(inner.planner, autoscale=False),
    )
    profile = c.profile_text(config)  # the router's live plan reads it, beside the config
    rolled = c.config_yaml(scaled, source) + (profile or "")
    checksum = hashlib.sha256(rolled.encode()).hexdigest()[:16]
    data = {"config.yaml": config_text}
    if profile is not None:
        data[Path(c.PROFILE_PATH).name] = profile
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": pods.CONFIG, "labels": pods.labels("config")},
        "data": data,
    }
    resources: dict[str, list[dict]] = {"configmap.yaml": [configmap]}
    claims = pods.claims(config)
    if claims:
        resources["volumes.yaml"] = claims
    if c.uses_bundled_redis(config):
        resources["redis.yaml"] = pods.redis()
    resources["router.yaml"] = pods.router(config, image, checksum)
    for role in Role:
        resources[f"{role.value}.yaml"] = [pods.worker(config, role, image, checksum)]
    resources["network.yaml"] = [pods.network_policy()]
    return resources


def gpu_overlay(image: str, gpus_per_pod: int = 1) -> dict[str, list[dict]]:
    name = image.rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image
    patch = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "pdserve-workers"},  # the target selector picks the workers
        "spec": {"template": {"spec": {
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                             "effect": "NoSchedule"}],
            "containers": [{"name": pods.WORKER_CONTAINER,
                            "resources": {"limits": {"nvidia.com/gpu": gpus_per_pod}}}],
        }}},
    }  # fmt: skip
    kustomization = {
        "apiVersion": KUSTOMIZE_API,
        "kind": "Kustomization",
        "resources": ["../../base"],
        "images": [{"name": name, "newTag": "cuda"}],
        "patches": [{"path": "gpu-workers.yaml",
                     "target": {"kind": "Deployment", "labelSelector": pods.ROLE_LABEL}}],
    }  # fmt: skip
    return {"kustomization.yaml": [kustomization], "gpu-workers.yaml": [patch]}


# Where KEDA's Prometheus scaler asks for the router's metrics when ``--prometheus-url``
# does not say: the Prometheus Operator's default (it must scrape the router's /metrics).
PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"
KEDA_API = "keda.sh/v1alpha1"
# The longest scale-down stabilization window Kubernetes' HPA accepts (its API refuses
# more: a ScaledObject asking it would not apply).
MAX_STABILIZATION_S = 3600


def autoscale_overlay(config: PdserveConfig, prometheus_url: str) -> dict[str, list[dict]]:
    """The base plus a KEDA ScaledObject per role: replicas = the routers' plans summed
    (``pdserve:planned_replicas{role}``, threshold 1), between ``planner.min_<role>_replicas``
    and the role's ``replicas``, polled every ``planner.interval_s``; a lower plan must hold
    ``planner.scale_in_delay_s`` before pods go (the HPA's scale-down stabilization), and
    they drain on SIGTERM as any scaled-in worker does. The scaled Deployments lose
    their ``spec.replicas`` (a patch): with it, every ``kubectl apply -k`` of the overlay
    set the role back to the config's count, undoing the autoscaler's.

    Summed, not the largest: each router sizes the traffic it served, so with the router
    Deployment scaled to N, each plans for about 1/N of it, and the largest plan would
    under-provision N-fold; the sum over-provisions by at most N - 1 workers (each plan
    rounded up), the safe side. With one router the two are the same."""
    planner = config.planner
    if planner.scale_in_delay_s > MAX_STABILIZATION_S:
        raise ConfigError("planner.scale_in_delay_s", f"Kubernetes' HPA waits at most "
                          f"{MAX_STABILIZATION_S} s before scaling in; got "
                          f"{planner.scale_in_delay_s:g}")  # fmt: skip
    least = {Role.PREFILL: planner.min_prefill_replicas, Role.DECODE: planner.min_decode_replicas}
    scaled_objects = [
        {
            "apiVersion": KEDA_API,
            "kind": "ScaledObject",
            "metadata": {"name": pods.worker_name(role), "labels": pods.labels(role.value)},
            "spec": {
                "scaleTargetRef": {"name": pods.worker_name(role)},
                "minReplicaCount": least[role],
                "maxReplicaCount": config.role(role).replicas,
                "pollingInterval": max(1, round(planner.interval_s)),
                "advanced": {
                    "horizontalPodAutoscalerConfig": {
                        "behavior": {
                            "scaleDown": {
                                "stabilizationWindowSeconds": round(planner.scale_in_delay_s),
                                "policies": [{"type": "Pods", "value": 1, "periodSeconds": 15}],
                            }
                        }
                    }
                },
                "triggers": [
                    {
                        "type": "prometheus",
                        "metadata": {
                            "serverAddress": prometheus_url,
                            "query": f'sum(pdserve:planned_replicas{{role="{role.value}"}})',
                            "threshold": "1",
                        },
                    }
                ],
            },
        }
        for role in Role
        if config.role(role).replicas
    ]
    unpinned = [{"target": {"kind": "Deployment", "name": pods.worker_name(role)},
                 "patch": yaml.safe_dump([{"op": "remove", "path": "/spec/replicas"}])}
                for role in Role if config.role(role).replicas]  # fmt: skip
    kustomization = {"apiVersion": KUSTOMIZE_API, "kind": "Kustomization",
                     "resources": ["../../base", "scaledobjects.yaml"],
                     "patches": unpinned}  # fmt: skip
    return {"kustomization.yaml": [kustomization], "scaledobjects.yaml": scaled_objects}
