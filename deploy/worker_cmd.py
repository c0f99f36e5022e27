"""``pdserve prefill`` and ``pdserve decode``: run one worker of the config's layout."""

from __future__ import annotations

import argparse
import sys

from common.config import ConfigError, Role


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="deployment YAML (default: built-in)")
    parser.add_argument("--index", type=int, default=0, help="which replica of the role")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set engine.block_size=32 (repeatable)",
    )


def _runner(role: Role):
    def run(args: argparse.Namespace) -> int:
        from common.config_loader import load_config
        from common.registry import RegistryError
        from worker.main import run as run_worker

        try:
            config = load_config(args.config, args.overrides)
            return run_worker(config, role, args.index)
        except (ConfigError, RegistryError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2

    return run


PREFILL = ("run a prefill worker", add_arguments, _runner(Role.PREFILL))
DECODE = ("run a decode worker", add_arguments, _runner(Role.DECODE))
