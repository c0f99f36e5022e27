"""The arguments subcommands share: ``--set KEY=VALUE`` overrides, loading the config with its
validation error printed as the command's answer (exit 2), and comma-separated lists."""

from __future__ import annotations

import argparse
import sys

from common.config import PdserveConfig
from common.config_base import ConfigError


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


def float_list(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def int_list(text: str) -> list[int]:
    values = float_list(text)
    if any(v != int(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return [int(v) for v in values]
