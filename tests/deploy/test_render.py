"""Rendered compose files and Kubernetes manifests: they parse, carry the config's replica
counts and ports, reference only services, volumes, ports, images and keys that exist, and
the committed deploy/compose.yaml and deploy/k8s/ are the renderer's output for the demo
config. Schema validation runs where the validators are installed (compose-spec,
kubernetes-validate); no docker engine or cluster is needed."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from common.config import PdserveConfig, Role
from common.config_base import ConfigError
from common.config_loader import build, load_config
from common.engine_config import DType
from common.redis_password import url_password, without_password
from deploy import containers
from deploy.cli import main as deploy_main
from deploy.render_compose import render
from deploy.render_k8s import PROMETHEUS, render_files, render_stream
from engine.models.fp8_maker import quantize_checkpoint
from tests.support.processes import ROOT

EXAMPLES = sorted((ROOT / "deploy" / "configs").glob("*.yaml"))
DEMO = ROOT / "deploy" / "configs" / "1p1d-demo.yaml"


def unusual_config(tmp_path: Path) -> Path:
    """A layout no example uses: 3P2D, shared storage, a local model, a LoRA adapter,
    custom ports."""
    model = tmp_path / "my-model"
    model.mkdir(exist_ok=True)
    path = tmp_path / "unusual.yaml"
    path.write_text(yaml.safe_dump({
        "model": str(model),
        "prefill": {"replicas": 3, "port": 41000, "drain_grace_s": 90},
        "decode": {"replicas": 2, "port": 42000, "engine": {"max_num_seqs": 8}},
        "kv_transfer": {"connector": "shared_storage", "shared_dir": str(tmp_path / "kv")},
        "router": {"host": "0.0.0.0", "port": 9000, "drain_grace_s": 20},
        "lora": {"adapters": {"alice": str(tmp_path / "adapters" / "a1")}},
    }))  # fmt: skip
    return path


def configs(tmp_path: Path) -> list[Path]:
    return [*EXAMPLES, unusual_config(tmp_path)]


# ---------------------------------------------------------------------------- compose


def check_compose(document: dict, config: PdserveConfig, image: str) -> None:
    services = document["services"]
    expected = [f"{role.value}-{i}" for role in Role for i in range(config.role(role).replicas)]
    assert [s for s in services if s not in ("redis", "router")] == expected
    assert "redis" in services and "router" in services
    inner = build(PdserveConfig, yaml.safe_load(document["configs"]["pdserve-config"]["content"]))
    assert inner.registry.redis_url == "redis://redis:6379/0"
    assert (inner.prefill.replicas, inner.decode.replicas) == (
        config.prefill.replicas, config.decode.replicas)  # fmt: skip
    assert inner.router.host == "0.0.0.0" and inner.router.port == config.router.port
    for name, service in services.items():
        assert service["image"] in (image, containers.REDIS_IMAGE)
        for dependency in service.get("depends_on", {}):
            assert dependency in services, (name, dependency)
        for mount in service.get("volumes", []):
            source = mount.split(":")[0]
            assert source.startswith("/") or source in document.get("volumes", {}), mount
        for ref in service.get("configs", []):
            assert ref["source"] in document["configs"]
            assert ref["target"] == containers.CONFIG_PATH
    for role in Role:
        for index in range(config.role(role).replicas):
            name = f"{role.value}-{index}"
            service = services[name]
            command = service["command"]
            assert command[command.index("--index") + 1] == str(index)
            assert f"{role.value}.host={name}" in command and service["hostname"] == name
            grpc_port = config.role(role).ports(index).grpc
            assert service["healthcheck"]["test"][-2:] == ["--grpc", f"{name}:{grpc_port}"]
            grace = int(service["stop_grace_period"].rstrip("s"))
            assert grace > config.role(role).drain_grace_s
            # The internal token: the host's variable, in every pdserve process.
            token = "${PDSERVE_INTERNAL_TOKEN:-}"
            assert service["environment"]["PDSERVE_INTERNAL_TOKEN"] == token
    router = services["router"]
    assert router["environment"]["PDSERVE_INTERNAL_TOKEN"] == token
    assert router["ports"][0].endswith(f"{config.router.port}:{config.router.port}")
    assert router["healthcheck"]["test"][-1] == f"http://127.0.0.1:{config.router.port}/health"
    assert set(router["depends_on"]) == {"redis", *expected}


def validate_compose_schema(text: str) -> None:
    import compose_spec  # a test dependency: the Compose Specification's JSON schema

    compose_spec.PyCompose.from_yaml(text).validate()


def test_compose_carries_each_config(tmp_path):
    for path in configs(tmp_path):
        config = load_config(str(path))
        for variant in ("cpu", "cuda"):
            text = render(config, path.name, variant)
            check_compose(yaml.safe_load(text), config, f"pdserve:{variant}")


@pytest.mark.parametrize(
    ("host", "published"),
    [("127.0.0.1", "127.0.0.1:8000:8000"), ("::1", "[::1]:8000:8000"), ("::", "8000:8000"),
     ("10.1.2.3", "10.1.2.3:8000:8000")],
)  # fmt: skip
def test_compose_publishes_the_router_on_its_host(host, published):
    """An IPv6 host in brackets, as compose reads it (``::1:8000:8000`` is ambiguous)."""
    config = load_config(str(DEMO), [f"router.host='{host}'"])
    document = yaml.safe_load(render(config, "demo.yaml", "cpu", "i"))
    assert document["services"]["router"]["ports"] == [published]


def test_compose_details_of_an_unusual_layout(tmp_path):
    path = unusual_config(tmp_path)
    document = yaml.safe_load(render(load_config(str(path)), path.name, "cuda", gpus=2))
    services = document["services"]
    assert services["router"]["ports"] == ["9000:9000"]  # router.host 0.0.0.0: all interfaces
    assert services["prefill-2"]["volumes"] == [
        f"{tmp_path / 'my-model'}:/models/my-model:ro",
        f"{tmp_path / 'adapters' / 'a1'}:/adapters/alice:ro",
        f"kv-shared:{containers.SHARED_KV_DIR}",
    ]
    assert services["router"]["volumes"] == [f"{tmp_path / 'my-model'}:/models/my-model:ro"]
    gpus = [s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
            for name, s in services.items() if name[-1].isdigit()]  # fmt: skip
    assert gpus == [["0"], ["1"], ["0"], ["1"], ["0"]]
    inner = yaml.safe_load(document["configs"]["pdserve-config"]["content"])
    assert inner["model"] == "/models/my-model"
    assert inner["lora"]["adapters"] == {"alice": "/adapters/alice"}
    assert inner["kv_transfer"]["shared_dir"] == containers.SHARED_KV_DIR
    assert services["prefill-0"]["stop_grace_period"] == "105s"


def test_tensor_parallel_workers_get_their_own_gpus(tmp_path):
    """Each worker its tensor_parallel_size GPUs, consecutively; wrapping past the host's."""
    from deploy.gpus import sharing_warning, worker_gpus

    config = load_config(str(DEMO), ["engine.tensor_parallel_size=2", "decode.replicas=2"])
    assert list(worker_gpus(config).values()) == [[0, 1], [2, 3], [4, 5]]
    assert list(worker_gpus(config, 4).values()) == [[0, 1], [2, 3], [0, 1]]
    # Shared GPUs are said (each worker takes gpu_memory_utilization of its GPU: the
    # later ones ran out of memory, and compose rendered it without a word).
    assert sharing_warning(config, 6) is None and sharing_warning(config, 0) is None
    warning = sharing_warning(config, 4)
    assert warning is not None and "need 6 GPUs and --gpus gives 4: up to 2 share" in warning
    assert "gpu_memory_utilization to at most 0.42" in warning  # (0.85 / 2)
    document = yaml.safe_load(render(config, "demo.yaml", "cuda"))
    devices = {name: s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
               for name, s in document["services"].items() if name[-1].isdigit()}  # fmt: skip
    assert devices == {"prefill-0": ["0", "1"], "decode-0": ["2", "3"], "decode-1": ["4", "5"]}
    files = render_files(config, "demo.yaml", "pdserve:test")
    patch = yaml.safe_load(files["overlays/gpu/gpu-workers.yaml"])
    container = patch["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2


def test_an_external_redis_is_kept_and_none_bundled():
    config = load_config(str(DEMO), ["registry.redis_url=redis://redis.internal:6379/3"])
    document = yaml.safe_load(render(config, "demo.yaml"))
    assert "redis" not in document["services"]
    inner = yaml.safe_load(document["configs"]["pdserve-config"]["content"])
    assert inner["registry"]["redis_url"] == "redis://redis.internal:6379/3"
    files = render_files(config, "demo.yaml")
    assert "redis.yaml" not in files["base/kustomization.yaml"]


def test_compose_schema(tmp_path):
    for path in configs(tmp_path):
        validate_compose_schema(render(load_config(str(path)), path.name, "cuda"))


# ---------------------------------------------------------------------------- kubernetes


def k8s_docs(files: dict[str, str], prefix: str = "base/") -> list[dict]:
    docs = []
    for name, text in files.items():
        if name.startswith(prefix) and not name.endswith("kustomization.yaml"):
            docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def check_k8s(files: dict[str, str], config: PdserveConfig, image: str) -> None:
    kustomization = yaml.safe_load(files["base/kustomization.yaml"])
    assert sorted(f"base/{r}" for r in kustomization["resources"]) == sorted(
        n for n in files if n.startswith("base/") and not n.endswith("kustomization.yaml")
    )
    docs = k8s_docs(files)
    by_kind: dict[str, dict[str, dict]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], {})[doc["metadata"]["name"]] = doc
    deployments = by_kind["Deployment"]
    for role in Role:
        deployment = deployments[f"pdserve-{role.value}"]
        assert deployment["spec"]["replicas"] == config.role(role).replicas
        assert deployment["spec"]["template"]["metadata"]["labels"]["pdserve.io/role"] == role
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        ports = config.role(role).ports(0)
        assert [p["containerPort"] for p in container["ports"]] == [
            ports.grpc, ports.events, ports.replay, ports.kv_transfer, ports.kv_store]  # fmt: skip
        assert container["readinessProbe"]["grpc"]["port"] == ports.grpc
        assert f"{role.value}.host=$(POD_IP)" in container["args"]
        assert "POD_IP" in [e["name"] for e in container["env"]]
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > config.role(role).drain_grace_s
    router = deployments["pdserve-router"]["spec"]["template"]["spec"]
    assert router["terminationGracePeriodSeconds"] > config.router.drain_grace_s + 5
    assert router["containers"][0]["lifecycle"]["preStop"]
    assert router["containers"][0]["ports"][0]["containerPort"] == config.router.port
    configmap = by_kind["ConfigMap"]["pdserve-config"]
    inner = build(PdserveConfig, yaml.safe_load(configmap["data"]["config.yaml"]))
    assert inner.registry.redis_url == "redis://pdserve-redis:6379/0"
    assert inner.router.host == "0.0.0.0"
    claims = by_kind.get("PersistentVolumeClaim", {})
    for name, deployment in deployments.items():
        pod = deployment["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        for container in pod["containers"]:
            assert container["image"] in (image, containers.REDIS_IMAGE), name
            port_names = {p["name"] for p in container["ports"]}
            for probe in ("readinessProbe", "livenessProbe"):
                for action in container[probe].values():
                    if isinstance(action, dict) and isinstance(action.get("port"), str):
                        assert action["port"] in port_names, (name, probe)
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, (name, mount)
        for volume in volumes.values():
            if "configMap" in volume:
                assert volume["configMap"]["name"] in by_kind["ConfigMap"]
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims
    # The internal ports keep to the deployment's pods; every pdserve process reads the
    # internal token from the (optional) Secret.
    (policy,) = by_kind["NetworkPolicy"].values()
    guarded = [d for d in deployments.values()
               if _selects(policy["spec"]["podSelector"],
                           d["spec"]["template"]["metadata"]["labels"])]  # fmt: skip
    assert sorted(d["metadata"]["name"] for d in guarded) == sorted(
        ["pdserve-prefill", "pdserve-decode"]
        + (["pdserve-redis"] if "pdserve-redis" in deployments else [])
    )
    (admitted,) = policy["spec"]["ingress"][0]["from"]
    assert all(_selects(admitted["podSelector"], d["spec"]["template"]["metadata"]["labels"])
               for d in deployments.values())  # fmt: skip
    for name in ("pdserve-router", "pdserve-prefill", "pdserve-decode"):
        (container,) = deployments[name]["spec"]["template"]["spec"]["containers"]
        (token,) = [e for e in container["env"] if e["name"] == "PDSERVE_INTERNAL_TOKEN"]
        assert token["valueFrom"]["secretKeyRef"]["optional"] is True
    for service in by_kind["Service"].values():
        targets = [d for d in deployments.values()
                   if service["spec"]["selector"].items()
                   <= d["spec"]["template"]["metadata"]["labels"].items()]  # fmt: skip
        assert len(targets) == 1, service["metadata"]["name"]
        port_names = {p["name"] for p in targets[0]["spec"]["template"]["spec"]["containers"][0]
                      ["ports"]}  # fmt: skip
        assert all(p["targetPort"] in port_names for p in service["spec"]["ports"])


def _selects(selector: dict, labels: dict) -> bool:
    """Whether a label selector (matchLabels, matchExpressions with In) selects ``labels``."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []))


def check_gpu_overlay(files: dict[str, str], image: str) -> None:
    overlay = yaml.safe_load(files["overlays/gpu/kustomization.yaml"])
    assert overlay["resources"] == ["../../base"]
    assert overlay["images"][0]["name"] == image.rsplit(":", 1)[0]
    patch_entry = overlay["patches"][0]
    patch = yaml.safe_load(files[f"overlays/gpu/{patch_entry['path']}"])
    selector = patch_entry["target"]["labelSelector"]
    targets = [d for d in k8s_docs(files) if d["kind"] == "Deployment"
               and selector in d["metadata"]["labels"]]  # fmt: skip
    assert sorted(d["metadata"]["name"] for d in targets) == ["pdserve-decode", "pdserve-prefill"]
    patched = patch["spec"]["template"]["spec"]["containers"][0]
    assert patched["resources"]["limits"]["nvidia.com/gpu"] == 1
    for target in targets:
        names = [c["name"] for c in target["spec"]["template"]["spec"]["containers"]]
        assert patched["name"] in names


def test_api_keys_are_never_written_into_the_rendered_files(tmp_path):
    """They went into the ConfigMap (and compose's config) as plain text; the router reads
    them from PDSERVE_API_KEYS: an optional Secret's, or the compose host's."""
    config = load_config(str(DEMO), ["router.api_keys=[sk-secret-1]"])
    document = yaml.safe_load(render(config, "demo.yaml", "cpu", "pdserve:cpu"))
    assert "sk-secret" not in yaml.safe_dump(document)
    router = document["services"]["router"]  # (required: the router must not start open)
    required = "${PDSERVE_API_KEYS:?set PDSERVE_API_KEYS: the config has router.api_keys}"
    assert router["environment"]["PDSERVE_API_KEYS"] == required
    files = render_files(config, "demo.yaml", "pdserve:cpu")
    assert not any("sk-secret" in text for text in files.values())
    (deployment,) = [d for d in k8s_docs(files) if d["metadata"]["name"] == "pdserve-router"
                     and d["kind"] == "Deployment"]  # fmt: skip
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (keys,) = [e for e in container["env"] if e["name"] == "PDSERVE_API_KEYS"]
    assert keys["valueFrom"]["secretKeyRef"] == {"name": "pdserve-api-keys", "key": "keys",
                                                 "optional": False}  # fmt: skip
    open_files = render_files(load_config(str(DEMO)), "demo.yaml", "pdserve:cpu")
    assert "optional: true" in open_files["base/router.yaml"].split("PDSERVE_API_KEYS")[1][:200]
    open_compose = yaml.safe_load(render(load_config(str(DEMO)), "demo.yaml", "cpu", "i"))
    assert open_compose["services"]["router"]["environment"]["PDSERVE_API_KEYS"] == (
        "${PDSERVE_API_KEYS:-}"
    )


def test_a_redis_password_is_never_written_into_the_rendered_files():
    """An external Redis URL's password went into the ConfigMap (and compose's config)
    as plain text; every container reads it from PDSERVE_REDIS_PASSWORD now: a Secret's
    (required), or the compose host's."""
    url = "redis://default:hunter2@redis.internal:6379/0"
    config = load_config(str(DEMO), [f"registry.redis_url={url}"])
    document = yaml.safe_load(render(config, "demo.yaml", "cpu", "pdserve:cpu"))
    assert "hunter2" not in yaml.safe_dump(document)
    inner = yaml.safe_load(document["configs"]["pdserve-config"]["content"])
    assert inner["registry"]["redis_url"] == "redis://default@redis.internal:6379/0"
    required = (
        "${PDSERVE_REDIS_PASSWORD:?set PDSERVE_REDIS_PASSWORD: registry.redis_url has a password}"
    )
    for service in document["services"].values():
        assert service["environment"]["PDSERVE_REDIS_PASSWORD"] == required
    files = render_files(config, "demo.yaml", "pdserve:cpu")
    assert not any("hunter2" in text for text in files.values())
    deployments = [d for d in k8s_docs(files) if d["kind"] == "Deployment"]
    assert len(deployments) == 3  # the router and both roles (no bundled redis)
    for deployment in deployments:
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        (password,) = [e for e in container["env"] if e["name"] == "PDSERVE_REDIS_PASSWORD"]
        assert password["valueFrom"]["secretKeyRef"] == {
            "name": "pdserve-redis", "key": "password", "optional": False}  # fmt: skip
    # Without a password in the URL: the variable may still give one; bundled: none.
    open_config = load_config(str(DEMO), ["registry.redis_url=redis://redis.internal:6379/0"])
    open_compose = yaml.safe_load(render(open_config, "demo.yaml", "cpu", "i"))
    assert open_compose["services"]["router"]["environment"]["PDSERVE_REDIS_PASSWORD"] == (
        "${PDSERVE_REDIS_PASSWORD:-}"
    )
    bundled = yaml.safe_load(render(load_config(str(DEMO)), "demo.yaml", "cpu", "i"))
    assert "PDSERVE_REDIS_PASSWORD" not in bundled["services"]["router"]["environment"]


def test_a_redis_password_in_the_urls_query_is_kept_out_too(capsys):
    """redis-py reads ``?password=`` as well (the form ``unix://`` URLs take): it went
    into the rendered files, ``config check``'s output and a bad URL's error (a security
    audit)."""
    url = "redis://redis.internal:6379/0?password=QPASS777&db=1"
    config = load_config(str(DEMO), [f"registry.redis_url={url}"])
    compose = yaml.safe_load(render(config, "demo.yaml", "cpu", "pdserve:cpu"))
    inner = yaml.safe_load(compose["configs"]["pdserve-config"]["content"])
    assert inner["registry"]["redis_url"] == "redis://redis.internal:6379/0?db=1"
    files = render_files(config, "demo.yaml", "pdserve:cpu")
    assert not any("QPASS777" in text for text in [yaml.safe_dump(compose), *files.values()])
    assert compose["services"]["router"]["environment"]["PDSERVE_REDIS_PASSWORD"].startswith(
        "${PDSERVE_REDIS_PASSWORD:?"
    )
    socket = "unix:///run/redis.sock?password=QPASS777"
    assert (url_password(socket), without_password(socket)) == ("QPASS777", socket[:22])
    socket = "unix://:UPASS555@/run/redis.sock?db=1"  # (urlunsplit gave "unix:/run/...")
    assert without_password(socket) == "unix:///run/redis.sock?db=1"
    assert without_password(socket, "***") == "unix://:***@/run/redis.sock?db=1"
    both = "redis://u:UPASS555@r:6379/0?password=QPASS777"
    assert deploy_main(["config", "check", str(DEMO), "--set", f"registry.redis_url={both}"]) == 0
    shown = capsys.readouterr().out
    assert "UPASS555" not in shown and "QPASS777" not in shown and "u:***@r" in shown
    with pytest.raises(ConfigError) as refused:
        load_config(str(DEMO), ["registry.redis_url=http://r/0?password=QPASS777"])
    assert "QPASS777" not in str(refused.value)
    # A key written percent-encoded or with "+" (redis-py decodes both): it was kept.
    for key in ("passw%6Frd", "pass%77ord", "%70assword"):
        encoded = f"redis://redis:6379/0?{key}=QPASS222&db=1"
        assert url_password(encoded) == "QPASS222"
        assert without_password(encoded) == "redis://redis:6379/0?db=1"


def test_k8s_carries_each_config(tmp_path):
    for path in configs(tmp_path):
        config = load_config(str(path))
        files = render_files(config, path.name, "registry.example.com:5000/pdserve:v1")
        check_k8s(files, config, "registry.example.com:5000/pdserve:v1")
        check_gpu_overlay(files, "registry.example.com:5000/pdserve:v1")


def test_k8s_volumes_of_an_unusual_layout(tmp_path):
    path = unusual_config(tmp_path)
    files = render_files(load_config(str(path)), path.name)
    docs = {(d["kind"], d["metadata"]["name"]): d for d in k8s_docs(files)}
    assert ("PersistentVolumeClaim", "pdserve-kv-shared") in docs
    assert ("PersistentVolumeClaim", "pdserve-models") in docs
    assert ("PersistentVolumeClaim", "pdserve-lora") in docs
    prefill = docs[("Deployment", "pdserve-prefill")]["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in prefill["containers"][0]["volumeMounts"]}
    assert mounts["kv-shared"] == containers.SHARED_KV_DIR
    assert mounts["models"] == "/models/my-model"
    assert mounts["lora"] == "/adapters"  # alice at /adapters/alice, as the config says
    router = docs[("Deployment", "pdserve-router")]["spec"]["template"]["spec"]
    assert "lora" not in {m["name"] for m in router["containers"][0]["volumeMounts"]}
    assert prefill["terminationGracePeriodSeconds"] == 105


@pytest.mark.parametrize(("host", "bound"), [("127.0.0.1", "0.0.0.0"), ("::", "::")])
def test_an_ipv6_clusters_router_listens_on_ipv6_in_kubernetes_only(host, bound):
    """``router.host: '::'`` (an IPv6-only cluster: its probes and Services reach the
    pod's IPv6 address, where a router on 0.0.0.0 listened not) is kept in Kubernetes;
    compose keeps 0.0.0.0 (Docker forwards a published port over IPv4)."""
    config = load_config(str(DEMO), [f"router.host='{host}'"])
    (configmap,) = [d for d in k8s_docs(render_files(config, "demo.yaml"))
                    if d["metadata"]["name"] == "pdserve-config"]  # fmt: skip
    assert yaml.safe_load(configmap["data"]["config.yaml"])["router"]["host"] == bound
    document = yaml.safe_load(render(config, "demo.yaml", "cpu", "i"))
    inner = yaml.safe_load(document["configs"]["pdserve-config"]["content"])
    assert inner["router"]["host"] == "0.0.0.0"


def test_k8s_schema(tmp_path):
    from kubernetes_validate import validate  # a test dependency: bundled k8s schemas

    for path in configs(tmp_path):
        files = render_files(load_config(str(path)), path.name)
        for doc in k8s_docs(files) + k8s_docs(files, "overlays/"):
            if doc["metadata"]["name"] != "pdserve-workers":  # a patch, not a resource
                validate(doc, "1.30.0", strict=True)


def test_stream_equals_the_base(tmp_path):
    config = load_config(str(unusual_config(tmp_path)))
    stream = [d for d in yaml.safe_load_all(render_stream(config, "u.yaml")) if d]
    assert stream == k8s_docs(render_files(config, "u.yaml"))


# ---------------------------------------------------------------------------- committed


def test_committed_files_are_the_demo_rendering():
    """deploy/compose.yaml and deploy/k8s/ are `pdserve deploy` of the 1P1D demo config;
    re-render them when the renderers or the demo config change (deploy/README.md)."""
    config = load_config(str(DEMO))
    assert (ROOT / "deploy" / "compose.yaml").read_text() == render(config, DEMO.name)
    files = render_files(config, DEMO.name)
    committed = {str(p.relative_to(ROOT / "deploy" / "k8s")): p.read_text()
                 for p in (ROOT / "deploy" / "k8s").rglob("*.yaml")}  # fmt: skip
    assert committed == files


def test_cli_renders_and_refuses_broken_configs(tmp_path):
    def pdserve(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "deploy.cli", *args], capture_output=True,
                              text=True, timeout=60, cwd=ROOT)  # fmt: skip

    path = unusual_config(tmp_path)
    out = tmp_path / "k8s"
    result = pdserve("deploy", "k8s", "--config", str(path), "--out", str(out),
                     "--set", "decode.replicas=4")  # fmt: skip
    assert result.returncode == 0, result.stderr
    decode = yaml.safe_load((out / "base" / "decode.yaml").read_text())
    assert decode["spec"]["replicas"] == 4
    assert (out / "overlays" / "gpu" / "kustomization.yaml").exists()
    broken = pdserve("deploy", "compose", "--config", str(path), "--set", "decode.replicas=-2")
    assert broken.returncode == 2 and "decode.replicas: must be >= 0" in broken.stderr


def test_scaling_a_role_rolls_no_pod_but_a_config_change_does():
    def checksums(*overrides: str) -> set[str]:
        files = render_files(load_config(str(DEMO), list(overrides)), DEMO.name)
        return {line.split("config-sha256: ")[1].rstrip("}")
                for text in files.values() for line in text.splitlines()
                if "config-sha256: " in line}  # fmt: skip

    one = checksums()
    assert len(one) == 1
    assert checksums("decode.replicas=3", "prefill.replicas=2") == one
    assert checksums("decode.drain_grace_s=45") != one


def test_worker_memory_requests_count_the_weights_as_held_on_cpu(tiny_llama, tmp_path):
    """A readable checkpoint adds its weights at the engine's dtype (float32 on CPU, or
    2 bytes for a 16-bit engine dtype), whatever the files store: an FP8 copy of the
    model asks for as much as the model; a model path only the cluster has adds nothing."""
    config_path = tmp_path / "local.yaml"
    config_path.write_text(yaml.safe_dump({
        "model": str(tiny_llama),
        "engine": {"kv_cache_bytes": 256 << 20, "kv_cache_dtype": "fp8"},
    }))  # fmt: skip
    config = load_config(str(config_path))
    num_weights = sum(t.numel() for t in load_file(tiny_llama / "model.safetensors").values())
    docs = {d["metadata"]["name"]: d for d in k8s_docs(render_files(config, "local.yaml"))}

    def requested_mib(name: str) -> int:
        container = docs[name]["spec"]["template"]["spec"]["containers"][0]
        return int(container["resources"]["requests"]["memory"].removesuffix("Mi"))

    base_mib = 256 + 1024
    assert requested_mib("pdserve-prefill") == base_mib + (num_weights * 4) // 2**20
    half = dataclasses.replace(config, engine=config.engine.replace(dtype=DType.BFLOAT16))
    docs = {d["metadata"]["name"]: d for d in k8s_docs(render_files(half, "local.yaml"))}
    assert requested_mib("pdserve-decode") == base_mib + (num_weights * 2) // 2**20
    fp8 = quantize_checkpoint(tiny_llama, tmp_path / "fp8", "fp8-block")
    assert sum(p.stat().st_size for p in fp8.glob("*.safetensors")) < 0.6 * sum(
        p.stat().st_size for p in tiny_llama.glob("*.safetensors")
    )  # the files shrank; what the engine holds did not
    docs = {d["metadata"]["name"]: d
            for d in k8s_docs(render_files(dataclasses.replace(config, model=str(fp8)),
                                           "local.yaml"))}  # fmt: skip
    assert requested_mib("pdserve-prefill") == base_mib + (num_weights * 4) // 2**20
    elsewhere = dataclasses.replace(config, model="/models/only-in-the-cluster")
    docs = {d["metadata"]["name"]: d for d in k8s_docs(render_files(elsewhere, "local.yaml"))}
    assert requested_mib("pdserve-prefill") == base_mib
    # Tensor parallelism: a KV pool and a runtime per rank, the weights split over them.
    split = dataclasses.replace(config, engine=config.engine.replace(tensor_parallel_size=2))
    docs = {d["metadata"]["name"]: d for d in k8s_docs(render_files(split, "local.yaml"))}
    assert requested_mib("pdserve-prefill") == 2 * base_mib + (num_weights * 4) // 2**20


def test_k8s_mounts_the_adapters_volume_for_runtime_loading(tmp_path):
    """No adapter at start, but some may be loaded later: the workers need the volume."""
    base = load_config(None, ["model=/models/m"])
    runtime = load_config(None, ["model=/models/m", "lora.runtime_loading=true"])
    for config, mounted in ((base, False), (runtime, True)):
        docs = {(d["kind"], d["metadata"]["name"]): d
                for d in k8s_docs(render_files(config, "c.yaml"))}  # fmt: skip
        assert (("PersistentVolumeClaim", "pdserve-lora") in docs) is mounted
        decode = docs[("Deployment", "pdserve-decode")]["spec"]["template"]["spec"]
        mounts = {m["name"]: m["mountPath"] for m in decode["containers"][0]["volumeMounts"]}
        assert (mounts.get("lora") == "/adapters") is mounted


def test_a_draft_model_is_mounted_for_the_workers(tmp_path, tiny_llama):
    """``engine.draft_model``: each worker mounts it read-only under /draft-models (compose:
    a bind mount; k8s: a claim), the router does not, and the containers' config names
    the mount; the roles must name the same draft."""
    draft = tmp_path / "small-draft"
    draft.symlink_to(tiny_llama)
    path = tmp_path / "drafting.yaml"
    path.write_text(yaml.safe_dump({
        "engine": {"speculative_method": "draft_model", "draft_model": str(draft),
                   "num_speculative_tokens": 3},
    }))  # fmt: skip
    config = load_config(str(path))
    text = render(config, path.name)
    validate_compose_schema(text)
    services = yaml.safe_load(text)["services"]
    mount = f"{draft.resolve()}:/draft-models/small-draft:ro"
    assert mount in services["decode-0"]["volumes"] and mount in services["prefill-0"]["volumes"]
    assert mount not in services["router"].get("volumes", [])
    inner = yaml.safe_load(yaml.safe_load(text)["configs"]["pdserve-config"]["content"])
    assert inner["engine"]["draft_model"] == "/draft-models/small-draft"
    from kubernetes_validate import validate

    docs = {(d["kind"], d["metadata"]["name"]): d for d in k8s_docs(render_files(config, "d"))}
    for doc in docs.values():
        validate(doc, "1.30.0", strict=True)
    assert ("PersistentVolumeClaim", "pdserve-draft-model") in docs
    for name, mounted in (("pdserve-decode", True), ("pdserve-router", False)):
        pod = docs[("Deployment", name)]["spec"]["template"]["spec"]
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert (mounts.get("draft-model") == "/draft-models/small-draft") is mounted
    other = dataclasses.replace(config, decode=dataclasses.replace(
        config.decode, engine={"draft_model": str(tmp_path / "another")}))  # fmt: skip
    with pytest.raises(ConfigError, match="same draft_model"):
        render(other, path.name)


# ---------------------------------------------------------------------------- planner


def planned_config(tmp_path: Path, profile_text: str) -> PdserveConfig:
    profile = tmp_path / "profile.json"
    profile.write_text(profile_text)
    return load_config(str(DEMO), [f"planner.profile={profile}", "planner.autoscale=true",
                                   "decode.replicas=4", "planner.min_decode_replicas=2",
                                   "planner.scale_in_delay_s=90"])  # fmt: skip


def test_the_live_plans_profile_travels_with_the_config_and_keda_follows_it(tmp_path):
    """The router reads ``planner.profile`` in its container: both renderings carry the
    file beside the config; Kubernetes gets an overlay scaling each role on the plan."""
    from kubernetes_validate import validate

    from deploy.render_compose import compose_document
    from planner.profile_data import write_profile
    from tests.support.profiles import make_profile

    write_profile(make_profile(), tmp_path / "made.json")
    text = (tmp_path / "made.json").read_text()
    config = planned_config(tmp_path, text)
    files = render_files(config, "planned.yaml")
    configmap = yaml.safe_load(files["base/configmap.yaml"])
    assert configmap["data"]["profile.json"] == text
    inner = yaml.safe_load(configmap["data"]["config.yaml"])
    assert inner["planner"]["profile"] == containers.PROFILE_PATH == "/etc/pdserve/profile.json"
    for doc in k8s_docs(files):
        validate(doc, "1.30.0", strict=True)
    overlay = yaml.safe_load(files["overlays/autoscale/kustomization.yaml"])
    assert overlay["resources"] == ["../../base", "scaledobjects.yaml"]
    # The scaled Deployments lose spec.replicas: every apply of the overlay set the
    # roles back to the config's counts, undoing KEDA's.
    unpinned = {p["target"]["name"]: yaml.safe_load(p["patch"]) for p in overlay["patches"]}
    remove = [{"op": "remove", "path": "/spec/replicas"}]
    assert unpinned == {"pdserve-prefill": remove, "pdserve-decode": remove}
    objects = yaml.safe_load_all(files["overlays/autoscale/scaledobjects.yaml"])
    scaled = {d["metadata"]["name"]: d["spec"] for d in objects}
    decode = scaled["pdserve-decode"]
    assert (decode["minReplicaCount"], decode["maxReplicaCount"]) == (2, 4)
    assert decode["scaleTargetRef"] == {"name": "pdserve-decode"}
    assert decode["triggers"][0]["metadata"]["query"] == (
        'sum(pdserve:planned_replicas{role="decode"})'  # one plan per router, summed
    )
    assert decode["triggers"][0]["metadata"]["serverAddress"] == PROMETHEUS
    url = "http://prom.obs.svc:9090"
    asked = render_files(config, "planned.yaml", prometheus_url=url)
    (scaled_object, _) = yaml.safe_load_all(asked["overlays/autoscale/scaledobjects.yaml"])
    assert scaled_object["spec"]["triggers"][0]["metadata"]["serverAddress"] == url
    behavior = decode["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 90
    assert scaled["pdserve-prefill"]["minReplicaCount"] == 0
    # A new profile rolls the pods (the router reads it at start); the same one does not.
    other = text.replace('"machine": "cpu"', '"machine": "other"')
    assert other != text
    for name in ("same", "other"):
        (tmp_path / name).mkdir()
    same_config = planned_config(tmp_path / "same", text)
    other_config = planned_config(tmp_path / "other", other)
    assert router_annotations(config) == router_annotations(same_config)
    assert router_annotations(config) != router_annotations(other_config)
    # A scale-in delay past what the HPA takes is refused (its API would reject it).
    (tmp_path / "slow").mkdir()
    slow = planned_config(tmp_path / "slow", text)
    planner = dataclasses.replace(slow.planner, scale_in_delay_s=7200)
    slow = dataclasses.replace(slow, planner=planner)
    with pytest.raises(ConfigError, match="planner.scale_in_delay_s: .* at most 3600 s"):
        render_files(slow, "planned.yaml")

    document = compose_document(config, "planned.yaml")
    assert document["configs"]["pdserve-profile"]["content"] == text.replace("$", "$$")
    assert {"source": "pdserve-profile", "target": containers.PROFILE_PATH} in (
        document["services"]["router"]["configs"]
    )
    validate_compose_schema(render(config, "planned.yaml"))


def router_annotations(config: PdserveConfig) -> dict:
    router = next(yaml.safe_load_all(render_files(config, "p.yaml")["base/router.yaml"]))
    return router["spec"]["template"]["metadata"]["annotations"]


def test_a_profile_the_deployment_cannot_carry_is_refused(tmp_path):
    config = planned_config(tmp_path, "{}")
    with pytest.raises(ConfigError, match="planner.profile: .* is not a pdserve profile"):
        render_files(config, "planned.yaml")
