"""Render a docker-compose file from a deployment config.

One service per worker replica (``prefill-0``, ``decode-1``, ...), each on the ports the
config gives replica i, with its service name as its host: worker ids and logs read like
the config, and changing a replica count is a re-render plus ``docker compose up -d
--remove-orphans`` (new replicas join through Redis; removed ones get SIGTERM and drain).
Plus Redis (the registry, unless the config names an external one) and the router,
published on the config's router address. See ``deploy/containers.py`` for how the config
is adapted to containers, and ``deploy/README.md`` for the reasons.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.api_keys import API_KEYS_ENV
from common.config import PdserveConfig, Role
from common.hosts import is_wildcard, url_host
from common.internal_auth import TOKEN_ENV
from common.redis_password import REDIS_PASSWORD_ENV
from deploy import containers as c
from deploy.gpus import worker_gpus
from deploy.yaml_text import dump_all

CONFIG_NAME = "pdserve-config"
PROFILE_NAME = "pdserve-profile"
KV_VOLUME = "kv-shared"
VARIANTS = ("cpu", "cuda")
_LOOPBACK = {"127.0.0.1", "localhost"}


def render(
    config: PdserveConfig, source: str, variant: str = "cpu", image: str = "", gpus: int = 0
) -> str:
    """The compose file as YAML text, with a header saying how to build and run it."""
    document = compose_document(config, source, variant, image, gpus)
    header = (
        f"# Rendered by `pdserve deploy compose` from {source}; re-render, do not edit.\n"
        f"# Build the image first (repo root): docker build -f deploy/Dockerfile "
        f"--build-arg VARIANT={variant} -t {image or c.default_image(variant)} .\n"
        "# Run: docker compose -f THIS_FILE up -d   Stop (drains): docker compose down\n"
    )
    return header + dump_all([document])


def compose_document(
    config: PdserveConfig, source: str, variant: str = "cpu", image: str = "", gpus: int = 0
) -> dict[str, Any]:
    """``gpus`` (cuda): GPUs on the host; each worker gets ``tensor_parallel_size`` of them,
    consecutively, wrapping around past ``gpus`` (``deploy.gpus``); 0 = as many as needed."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    image = image or c.default_image(variant)
    inner = c.container_config(config, redis_host="redis")
    services: dict[str, Any] = {}
    if c.uses_bundled_redis(config):
        services["redis"] = _redis()
    workers = [(role, i) for role in Role for i in range(config.role(role).replicas)]
    assignment = worker_gpus(config, gpus)
    for role, index in workers:
        services[f"{role.value}-{index}"] = _worker(
            config, role, index, image, variant, assignment[(role, index)]
        )
    services["router"] = _router(config, image, [f"{r.value}-{i}" for r, i in workers])
    document: dict[str, Any] = {
        "name": "pdserve",
        "services": services,
        "configs": {CONFIG_NAME: {"content": _escape(c.config_yaml(inner, source))}},
    }
    profile = c.profile_text(config)
    if profile is not None:  # the router's live plan reads it (its planner.profile)
        document["configs"][PROFILE_NAME] = {"content": _escape(profile)}
        services["router"]["configs"].append({"source": PROFILE_NAME, "target": c.PROFILE_PATH})
    if config.kv_transfer.connector == "shared_storage":
        document["volumes"] = {KV_VOLUME: {}}
    return document


def _escape(text: str) -> str:
    """Compose interpolates ``$`` everywhere, config content included."""
    return text.replace("$", "$$")


def _redis() -> dict[str, Any]:
    return {
        "image": c.REDIS_IMAGE,
        "command": ["redis-server", "--save", "", "--appendonly", "no"],
        "healthcheck": {
            "test": ["CMD", "redis-cli", "ping"],
            "interval": "2s",
            "timeout": "2s",
            "retries": 10,
        },
        "restart": "unless-stopped",
    }


def _common(config: PdserveConfig, image: str) -> dict[str, Any]:
    service: dict[str, Any] = {
        "image": image,
        "configs": [{"source": CONFIG_NAME, "target": c.CONFIG_PATH}],
        # The internal ports' token (``common/internal_auth.py``): the host's, if set.
        "environment": {"PYTHONUNBUFFERED": "1", TOKEN_ENV: _from_host(TOKEN_ENV)},
        "restart": "unless-stopped",
    }
    if config.model is not None:
        model = Path(config.model).resolve()
        service["volumes"] = [f"{model}:{c.container_model_path(config)}:ro"]
    # An external Redis's password (``common/redis_password.py``): the host's, never
    # written here; required when the config's URL had one.
    needed = c.redis_password_needed(config)
    if needed is not None:
        because = "registry.redis_url has a password" if needed else None
        service["environment"][REDIS_PASSWORD_ENV] = _from_host(REDIS_PASSWORD_ENV, because)
    return service


def _from_host(name: str, required_because: str | None = None) -> str:
    """The compose host's variable ``name``: empty when unset, or, given why it is
    required, compose refuses to start without it (saying why)."""
    unset = f":?set {name}: {required_because}" if required_because else ":-"
    return f"${{{name}{unset}}}"


def _worker(
    config: PdserveConfig, role: Role, index: int, image: str, variant: str, gpus: list[int]
) -> dict[str, Any]:
    name = f"{role.value}-{index}"
    section = config.role(role)
    service = _common(config, image)
    for adapter, path in sorted(config.lora.adapters.items()):  # the router needs names only
        volume = f"{Path(path).resolve()}:{c.container_adapter_path(adapter)}:ro"
        service.setdefault("volumes", []).append(volume)
    draft = c.draft_model_dir(config)
    if draft is not None:
        volume = f"{Path(draft).resolve()}:{c.container_draft_path(config)}:ro"
        service.setdefault("volumes", []).append(volume)
    service.update(
        hostname=name,
        command=c.worker_args(role, index, host=name),
        labels={"io.pdserve.role": role.value, "io.pdserve.index": str(index)},
        healthcheck=_healthcheck(["--grpc", f"{name}:{section.ports(index).grpc}"]),
        stop_grace_period=f"{c.stop_grace_s(section.drain_grace_s)}s",
    )
    if config.kv_transfer.connector == "shared_storage":
        service.setdefault("volumes", []).append(f"{KV_VOLUME}:{c.SHARED_KV_DIR}")
    if c.uses_bundled_redis(config):
        service["depends_on"] = {"redis": {"condition": "service_healthy"}}
    if variant == "cuda":
        # CUDA IPC and PyTorch's shared memory need the host IPC namespace. GPUs per
        # worker by id: `count: N` would hand every container the same first GPUs.
        service["ipc"] = "host"
        device_ids = [str(gpu) for gpu in gpus]
        device = {"driver": "nvidia", "device_ids": device_ids, "capabilities": ["gpu"]}
        service["deploy"] = {"resources": {"reservations": {"devices": [device]}}}
    return service


def _router(config: PdserveConfig, image: str, workers: list[str]) -> dict[str, Any]:
    router = config.router
    service = _common(config, image)
    published = f"{router.port}:{router.port}"
    if router.host in _LOOPBACK:
        published = f"127.0.0.1:{published}"
    elif not is_wildcard(router.host):
        published = f"{url_host(router.host)}:{published}"
    # Client keys (``common/api_keys.py``): the host's, never written here; required when
    # the config has keys (compose refuses to start without them: the router must not
    # serve open).
    because = "the config has router.api_keys" if router.api_keys else None
    service["environment"][API_KEYS_ENV] = _from_host(API_KEYS_ENV, because)
    depends = {name: {"condition": "service_healthy"} for name in workers}
    if c.uses_bundled_redis(config):
        depends = {"redis": {"condition": "service_healthy"}, **depends}
    service.update(
        command=c.router_args(),
        ports=[published],
        depends_on=depends,
        healthcheck=_healthcheck(["--http", f"http://127.0.0.1:{router.port}/health"]),
        stop_grace_period=f"{c.stop_grace_s(router.drain_grace_s)}s",
    )
    return service


def _healthcheck(probe: list[str]) -> dict[str, Any]:
    return {
        "test": ["CMD", "python", "-m", "deploy.health_cmd", *probe],
        "interval": "5s",
        "timeout": "5s",
        "retries": 3,
        # Loading the model may take long; failures meanwhile do not count.
        "start_period": "10m",
    }
