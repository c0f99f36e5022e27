"""How one deployment config becomes containers: the choices compose and Kubernetes share.

The config a user writes describes one machine (every host 127.0.0.1, the static worker
list, local paths). Containers differ in four ways, and ``container_config`` rewrites just
those, so the layout (replicas, ports, engine, connector, timeouts) stays the user's:

- **Discovery.** Container addresses are not known in advance, so workers register in
  Redis: ``registry.redis_url`` points at the bundled Redis service, unless the config
  already names a Redis that is not on loopback (an external one; then none is bundled).
- **Binding.** A worker binds every socket (gRPC, KV events, connector) on its role's
  host *and* advertises that same address to the router and to peers, so it must be an
  address others can reach: never 0.0.0.0. Each worker container therefore gets its own
  host on its command line (``--set prefill.host=...``): its service name in compose
  (resolvable by every container, and bindable in its own), its pod IP in Kubernetes,
  IPv4 or IPv6. The router is advertised nowhere, so it binds every interface: 0.0.0.0,
  or in Kubernetes ``::`` when the config's ``router.host`` is ``::`` (an IPv6-only
  cluster, whose probes and Services reach the pod's IPv6 address). Compose keeps
  0.0.0.0: Docker forwards a published port to the container's IPv4 address.
- **Paths.** The shared-storage directory is a shared volume at ``SHARED_KV_DIR``; a
  local model directory is mounted read-only under ``MODELS_DIR`` with its name kept (the
  served model name defaults to it). Without a model, the image's baked-in demo is used.
  LoRA adapters are mounted read-only at ``ADAPTERS_DIR/<adapter name>``, a draft model
  (``engine.draft_model``) at ``DRAFTS_DIR/<its name>``.
- **Config file.** The rewritten config is mounted at ``CONFIG_PATH`` in every container,
  and the live plan's profile (``planner.profile``), read from this machine, beside it at
  ``PROFILE_PATH``: it travels with the config.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from urllib.parse import urlparse

import yaml

from common.config import PdserveConfig, Role
from common.config_base import ConfigError
from common.config_loader import to_dict
from common.hosts import host_port
from common.redis_password import url_password, without_password

CONFIG_PATH = "/etc/pdserve/config.yaml"
PROFILE_PATH = "/etc/pdserve/profile.json"
SHARED_KV_DIR = "/var/lib/pdserve/kv-shared"
MODELS_DIR = "/models"
ADAPTERS_DIR = "/adapters"
DRAFTS_DIR = "/draft-models"
REDIS_PORT = 6379
REDIS_IMAGE = "redis:7.4-alpine"
IMAGE_NAME = "pdserve"  # tags: cpu, cuda (deploy/Dockerfile's VARIANT)
_LOOPBACK = {"localhost", "127.0.0.1", "::1", ""}


def default_image(variant: str = "cpu") -> str:
    return f"{IMAGE_NAME}:{variant}"


def uses_bundled_redis(config: PdserveConfig) -> bool:
    """False when the config names an external Redis (not on loopback)."""
    url = config.registry.redis_url
    return url is None or (urlparse(url).hostname or "") in _LOOPBACK


def redis_password_needed(config: PdserveConfig) -> bool | None:
    """Whether the containers need ``PDSERVE_REDIS_PASSWORD``: True when the config's
    external Redis URL holds a password (kept out of the rendered files), False for an
    external Redis without one (the variable may still give one), None for the bundled
    Redis (no password)."""
    if uses_bundled_redis(config):
        return None
    return url_password(config.registry.redis_url or "") is not None


def container_config(
    config: PdserveConfig, redis_host: str, router_host: str = "0.0.0.0"
) -> PdserveConfig:
    """The config every container reads (see the module docstring for what changes);
    ``router_host``: the wildcard the router binds."""
    registry = config.registry
    if uses_bundled_redis(config):
        url = f"redis://{host_port(redis_host, REDIS_PORT)}/0"
        registry = dataclasses.replace(registry, redis_url=url)
    elif registry.redis_url is not None:  # its password: PDSERVE_REDIS_PASSWORD's
        registry = dataclasses.replace(registry, redis_url=without_password(registry.redis_url))
    transfer = config.kv_transfer
    if transfer.connector == "shared_storage":
        transfer = dataclasses.replace(transfer, shared_dir=SHARED_KV_DIR)
    adapters = {name: container_adapter_path(name) for name in config.lora.adapters}
    engine, prefill, decode = config.engine, config.prefill, config.decode
    draft = container_draft_path(config)
    if draft is not None:  # wherever the config names it
        if engine.draft_model is not None:
            engine = engine.replace(draft_model=draft)
        if "draft_model" in prefill.engine:
            prefill = dataclasses.replace(prefill, engine={**prefill.engine, "draft_model": draft})
        if "draft_model" in decode.engine:
            decode = dataclasses.replace(decode, engine={**decode.engine, "draft_model": draft})
    planner = config.planner
    if planner.profile is not None:
        planner = dataclasses.replace(planner, profile=PROFILE_PATH)
    return dataclasses.replace(
        config,
        planner=planner,
        model=container_model_path(config),
        engine=engine,
        prefill=prefill,
        decode=decode,
        lora=dataclasses.replace(config.lora, adapters=adapters),
        # Keys are secrets: the router reads them from PDSERVE_API_KEYS (``common/api_keys.py``).
        router=dataclasses.replace(config.router, host=router_host, api_keys=[]),
        registry=registry,
        kv_transfer=transfer,
    )


def profile_text(config: PdserveConfig) -> str | None:
    """The live plan's profile file as text (it goes into the deployment beside the
    config), checked as a profile; None without one. Raises ``ConfigError``."""
    if config.planner.profile is None:
        return None
    from planner.profile_data import ProfileError, read_profile

    path = Path(config.planner.profile)
    try:
        read_profile(path)
    except ProfileError as exc:
        raise ConfigError("planner.profile", f"{exc}; the deployment carries it") from None
    return path.read_text()


def container_model_path(config: PdserveConfig) -> str | None:
    if config.model is None:
        return None
    return f"{MODELS_DIR}/{Path(config.model).name}"


def draft_model_dir(config: PdserveConfig) -> str | None:
    """The draft model's local directory (``engine.draft_model``), or None without one.
    Raises ``ConfigError`` if the roles name different ones: containers mount one."""
    drafts = {config.engine_for(role).draft_model for role in Role} - {None}
    if len(drafts) > 1:
        raise ConfigError(
            "decode.engine.draft_model",
            f"the roles name different draft models ({', '.join(sorted(map(str, drafts)))}); "
            "containers mount one, so both roles need the same draft_model",
        )
    return next(iter(drafts), None)


def container_draft_path(config: PdserveConfig) -> str | None:
    draft = draft_model_dir(config)
    return None if draft is None else f"{DRAFTS_DIR}/{Path(draft).name}"


def container_adapter_path(name: str) -> str:
    return f"{ADAPTERS_DIR}/{name}"


def config_yaml(config: PdserveConfig, source: str) -> str:
    header = (
        f"# pdserve config for containers, rendered from {source}.\n"
        "# Re-render after editing the source; see deploy/README.md.\n"
    )
    return header + yaml.safe_dump(to_dict(config), sort_keys=False)


def worker_args(role: Role, index: int, host: str) -> list[str]:
    """Arguments after the image's ``pdserve`` entry point for one worker."""
    return [
        "--log-level", "INFO", role.value, "--config", CONFIG_PATH,
        "--index", str(index), "--set", f"{role.value}.host={host}",
    ]  # fmt: skip


def router_args() -> list[str]:
    return ["--log-level", "INFO", "router", "--config", CONFIG_PATH]


def stop_grace_s(drain_grace_s: float, margin_s: float = 15.0) -> int:
    """How long the platform waits after SIGTERM before SIGKILL: the drain plus time to
    deregister and close (gRPC stop grace, engine thread, connector)."""
    return int(drain_grace_s + margin_s + 0.999)
