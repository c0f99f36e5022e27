"""The config arguments every subcommand shares: ``--set KEY=VALUE`` overrides, and loading
the config with its validation error printed as the command's answer (exit 2)."""

from __future__ import annotations

import argparse
import sys

from common.config import ConfigError, PdserveConfig


def add_overrides(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set decode.replicas=2 (repeatable)",
    )


def load_or_report(path: str | None, overrides: list[str]) -> PdserveConfig | None:
    """The validated config, or None after printing ``error: <key>: <reason>``."""
    from common.config_loader import load_config

    try:
        return load_config(path, overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
