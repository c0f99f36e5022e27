"""``pdserve prefill`` and ``pdserve decode``: run one worker of the config's layout."""

from __future__ import annotations

import argparse
import sys

from common.config import Role
from common.config_base import ConfigError
from deploy.config_args import add_overrides, load_or_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="deployment YAML (default: built-in)")
    parser.add_argument("--index", type=int, default=0, help="which replica of the role")
    add_overrides(parser)


def _runner(role: Role):
    def run(args: argparse.Namespace) -> int:
        from common.config_loader import load_config
        from common.registry import RegistryError
        from engine.models.errors import ModelLoadError
        from worker.main import run as run_worker

        try:
            config = load_config(args.config, args.overrides)
            return run_worker(config, role, args.index)
        except (ConfigError, RegistryError, ValueError, ModelLoadError, FileNotFoundError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2

    return run


def _run_router(args: argparse.Namespace) -> int:
    from common.config_loader import load_config
    from common.registry import RegistryError
    from common.tokenizer import TokenizerError
    from planner.profile_data import ProfileError
    from router.main import run as run_router

    try:
        config = load_config(args.config, args.overrides)
        return run_router(config)
    except (ConfigError, RegistryError, FileNotFoundError, ProfileError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _router_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="deployment YAML (default: built-in)")
    add_overrides(parser)


def _up_arguments(parser: argparse.ArgumentParser) -> None:
    _router_arguments(parser)
    parser.add_argument("--no-restart", dest="restart", action="store_false",
                        help="leave a worker that failed down (default: restart it, with "
                             "backoff, as compose's on-failure policy would)")  # fmt: skip
    parser.add_argument("--start-timeout", type=float, default=None, metavar="SECONDS",
                        help="how long the workers and router may take to be ready "
                             "(default: 1800, a large model's load)")  # fmt: skip


def _run_up(args: argparse.Namespace) -> int:
    from deploy.up import DEFAULT_START_TIMEOUT_S
    from deploy.up import run as run_up

    timeout_s = args.start_timeout if args.start_timeout is not None else DEFAULT_START_TIMEOUT_S
    if not timeout_s > 0:
        print(f"error: --start-timeout must be > 0, got {args.start_timeout}", file=sys.stderr)
        return 2
    config = load_or_report(args.config, args.overrides)
    return 2 if config is None else run_up(config, restart=args.restart, start_timeout_s=timeout_s)


ROUTER = ("run the OpenAI-compatible router", _router_arguments, _run_router)
UP = ("run the router and every worker of the config on this machine", _up_arguments, _run_up)
PREFILL = ("run a prefill worker", add_arguments, _runner(Role.PREFILL))
DECODE = ("run a decode worker", add_arguments, _runner(Role.DECODE))
