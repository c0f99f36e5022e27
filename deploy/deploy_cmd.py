"""``pdserve deploy compose|k8s --config FILE``: render the container deployment of a config.

    pdserve deploy compose --config F [--out FILE] [--variant cpu|cuda] [--image I] [--gpus N]
    pdserve deploy k8s     --config F [--out DIR]  [--image I] [--prometheus-url URL]

The config is validated first (exit 2 with the named key, as ``pdserve config check``).
Without ``--out`` the result goes to stdout: the compose file, or the Kubernetes base as
one stream for ``kubectl apply -f -``. With ``--out DIR`` the k8s command writes a
kustomize tree: ``DIR/base`` and ``DIR/overlays/gpu`` (and ``DIR/overlays/autoscale``
with ``planner.profile``, KEDA asking the Prometheus ``--prometheus-url`` names).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.config import PdserveConfig
from common.config_base import ConfigError
from common.redis_password import REDIS_PASSWORD_ENV, REDIS_PASSWORD_SECRET
from deploy import containers as c
from deploy.config_args import add_overrides, load_or_report
from deploy.gpus import sharing_warning
from deploy.render_k8s import PROMETHEUS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    targets = parser.add_subparsers(dest="target", required=True, metavar="TARGET")
    compose = targets.add_parser("compose", help="render a docker-compose file")
    _common(
        compose, "the compose file to write (default: stdout)", "image (default: pdserve:VARIANT)"
    )
    compose.add_argument("--variant", choices=("cpu", "cuda"), default="cpu")
    compose.add_argument(
        "--gpus",
        type=_count,
        default=0,
        help="cuda: GPUs on the host (0: as many as the workers' tensor_parallel_size need)",
    )
    k8s = targets.add_parser("k8s", help="render Kubernetes manifests (kustomize base + GPU)")
    _common(
        k8s,
        "directory for base/ and overlays/gpu/ (default: the base to stdout)",
        "image (default: pdserve:cpu in the base, pdserve:cuda in overlays/gpu)",
    )
    k8s.add_argument(
        "--prometheus-url",
        default="",
        help="with planner.profile: the Prometheus (scraping the routers) that KEDA asks, in "
        f"overlays/autoscale (default: {PROMETHEUS})",
    )


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _common(parser: argparse.ArgumentParser, out_help: str, image_help: str) -> None:
    parser.add_argument("--config", required=True, help="deployment YAML")
    parser.add_argument("--out", type=Path, default=None, help=out_help)
    parser.add_argument("--image", default="", help=image_help)
    add_overrides(parser)


def run(args: argparse.Namespace) -> int:
    config = load_or_report(args.config, args.overrides)
    if config is None:
        return 2
    source = Path(args.config).name
    for warning in planner_warnings(config, args.target):
        print(f"warning: {warning}", file=sys.stderr)
    if config.router.api_keys:
        where = ("the Secret: kubectl create secret generic pdserve-api-keys "
                 "--from-literal=keys=KEY1,KEY2" if args.target == "k8s"
                 else "the host's environment when compose starts")  # fmt: skip
        print("note: router.api_keys are secrets and are not written into the rendered files; "
              f"the router reads PDSERVE_API_KEYS from {where}", file=sys.stderr)  # fmt: skip
    if c.redis_password_needed(config):
        where = (f"the Secret: kubectl create secret generic {REDIS_PASSWORD_SECRET} "
                 "--from-literal=password=..." if args.target == "k8s"
                 else "the host's environment when compose starts")  # fmt: skip
        print("note: registry.redis_url's password is a secret and is not written into the "
              f"rendered files; the containers read {REDIS_PASSWORD_ENV} from {where}",
              file=sys.stderr)  # fmt: skip
    if args.target == "compose":
        from deploy.render_compose import render

        shared = sharing_warning(config, args.gpus) if args.variant == "cuda" else None
        if shared is not None:
            print(f"warning: {shared}", file=sys.stderr)
        try:
            text = render(config, source, args.variant, args.image, args.gpus)
        except ConfigError as exc:  # more GPUs than --gpus gives; a bad profile, say
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if args.out is None:
            sys.stdout.write(text)
        else:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
            print(f"wrote {args.out}")
        return 0
    from deploy.render_k8s import render_files, render_stream, write

    if args.prometheus_url and (args.out is None or config.planner.profile is None):
        print("warning: --prometheus-url is for overlays/autoscale, which only --out writes, "
              "and only with planner.profile", file=sys.stderr)  # fmt: skip

    try:  # (a planner profile or draft model the config names, read while rendering)
        if args.out is None:
            sys.stdout.write(render_stream(config, source, args.image))
            return 0
        files = render_files(config, source, args.image, args.prometheus_url)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    write(files, args.out)
    print(f"wrote {len(files)} files under {args.out} (kubectl apply -k {args.out}/base)")
    return 0


def planner_warnings(config: PdserveConfig, target: str) -> list[str]:
    """What a container deployment does with ``planner.autoscale``: the local launcher's
    scaling does not apply; Kubernetes has the autoscale overlay, compose nothing."""
    if not config.planner.autoscale:
        return []
    if target == "k8s":
        return [
            "planner.autoscale is `pdserve up`'s: the base runs every replica; "
            "overlays/autoscale scales the roles with KEDA on the router's "
            "pdserve:planned_replicas (from the Prometheus --prometheus-url names)"
        ]
    return ["planner.autoscale is `pdserve up`'s: compose runs every replica (the router "
            "still shows its plan: pdserve:planned_replicas)"]  # fmt: skip


COMMAND = ("render docker-compose or Kubernetes manifests from a config", add_arguments, run)
